//! Feature extraction: from a task context to weighted signals, data and
//! repository volumes, and a workload kind.
//!
//! All text fields (task, plan steps, tools, languages, dependencies) are
//! read together. ASCII keywords match whole words or phrases of a normalized
//! text (lowercase, punctuation → space, a break between ASCII and CJK runs);
//! CJK keywords match as substrings. Quantities with units (`20 GB`,
//! `10 million rows`, `1000万行`, `3.5GiB`) are parsed from the raw text and
//! attributed to the repository when a repository word precedes them, to
//! memory when `RAM`/`memory` follows them, else to the data.
//!
//! The [`workload_signature`] hashes the normalized features, never the text,
//! so rephrasings of the same work share telemetry.

use crate::context::TaskContext;
use crate::untrusted::{self, excerpt, ClauseRole};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fmt;

/// What kind of work dominates; decides which capability a class needs.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// A small script or command.
    Script,
    /// Data analysis: dataframes, spreadsheets, statistics, classic ML.
    Data,
    /// CPU-heavy work without a special capability (simulation, video, …).
    Compute,
    /// Compiling or bundling: Maven/Gradle, npm/webpack, cargo, make, gcc.
    Build,
    /// A real browser: Playwright, Puppeteer, Selenium, headless Chromium.
    Browser,
    /// Deep-learning training or anything asking for CUDA.
    Gpu,
}

impl WorkloadKind {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::Script => "script",
            WorkloadKind::Data => "data",
            WorkloadKind::Compute => "compute",
            WorkloadKind::Build => "build",
            WorkloadKind::Browser => "browser",
            WorkloadKind::Gpu => "gpu",
        }
    }
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Keyword groups; a group's score is the sum of its distinct signals' weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Group {
    Trivial,
    Data,
    Ml,
    Efficient,
    Distributed,
    BigData,
    Viz,
    Compute,
    Parallel,
    Build,
    Jvm,
    Monorepo,
    Browser,
    /// Words naming the hardware (`gpu`, `cuda`): not work by themselves.
    Gpu,
    /// Work that needs a GPU by itself (fine-tuning, LoRA).
    GpuWork,
    /// Deep-learning frameworks and model families.
    DeepLearning,
    /// Generic deep-learning words (`neural network`).
    DeepGeneric,
    Train,
    /// Toy scale (`from scratch`, `xor`, `iris`).
    Toy,
    /// Streaming, chunked, lazy or database readers.
    Stream,
    /// Multi-threaded streaming engines (polars, DuckDB).
    Threaded,
    /// Data that stays remote (S3, httpfs).
    Remote,
    /// Reading all of the data into memory, said explicitly.
    InMemory,
    /// Audio or video work.
    Media,
    Thumbnail,
    /// Unit-test runners.
    Tests,
    NoGpu,
    NoBrowser,
    FetchPypi,
    FetchOpen,
}

use Group as G;

/// (pattern, signal id, group, weight). ASCII patterns are lowercase words or
/// phrases in normalized form; patterns with non-ASCII match as substrings.
const KEYWORDS: &[(&str, &str, Group, f64)] = &[
    // trivial scripts
    ("hello world", "hello-world", G::Trivial, 3.0),
    ("helloworld", "hello-world", G::Trivial, 3.0),
    ("print", "print", G::Trivial, 0.5),
    ("echo", "echo", G::Trivial, 0.5),
    ("one liner", "one-liner", G::Trivial, 1.0),
    ("simple script", "simple-script", G::Trivial, 1.0),
    ("打印", "print", G::Trivial, 0.5),
    // dataframes, spreadsheets, statistics
    ("pandas", "pandas", G::Data, 2.0),
    ("pd read csv", "pandas", G::Data, 2.0),
    ("numpy", "numpy", G::Data, 1.0),
    ("scipy", "scipy", G::Data, 1.0),
    ("dataframe", "dataframe", G::Data, 2.0),
    ("dataframes", "dataframe", G::Data, 2.0),
    ("csv", "csv", G::Data, 1.0),
    ("excel", "excel", G::Data, 1.5),
    ("xlsx", "excel", G::Data, 1.5),
    ("xls", "excel", G::Data, 1.5),
    ("openpyxl", "excel", G::Data, 1.5),
    ("spreadsheet", "excel", G::Data, 1.5),
    ("statistics", "stats", G::Data, 1.0),
    ("stats", "stats", G::Data, 1.0),
    ("aggregate", "stats", G::Data, 0.5),
    ("group by", "stats", G::Data, 0.5),
    ("groupby", "stats", G::Data, 1.0),
    ("pivot", "stats", G::Data, 1.0),
    ("sales", "sales", G::Data, 0.5),
    ("revenue", "sales", G::Data, 0.5),
    ("data analysis", "data-analysis", G::Data, 1.5),
    ("analyze data", "data-analysis", G::Data, 1.5),
    ("etl", "etl", G::Data, 1.5),
    ("sql", "sql", G::Data, 1.0),
    ("sqlite", "sql", G::Data, 1.0),
    ("jupyter", "notebook", G::Data, 1.0),
    ("notebook", "notebook", G::Data, 1.0),
    ("统计", "stats", G::Data, 1.0),
    ("销售", "sales", G::Data, 0.5),
    ("数据", "data", G::Data, 0.5),
    ("表格", "excel", G::Data, 1.5),
    ("分析", "data-analysis", G::Data, 1.0),
    ("报表", "stats", G::Data, 1.0),
    // efficient columnar engines
    ("polars", "polars", G::Efficient, 2.0),
    ("pyarrow", "pyarrow", G::Efficient, 2.0),
    ("arrow", "pyarrow", G::Efficient, 1.0),
    ("parquet", "parquet", G::Efficient, 2.0),
    ("duckdb", "duckdb", G::Efficient, 2.0),
    // distributed / out-of-core
    ("dask", "dask", G::Distributed, 3.0),
    ("spark", "spark", G::Distributed, 3.0),
    ("pyspark", "spark", G::Distributed, 3.0),
    ("ray", "ray", G::Distributed, 2.0),
    // size words without numbers
    ("big data", "big-data", G::BigData, 2.0),
    ("large dataset", "large-dataset", G::BigData, 2.0),
    ("huge dataset", "large-dataset", G::BigData, 2.5),
    ("large data", "large-dataset", G::BigData, 2.0),
    ("millions of rows", "millions-of-rows", G::BigData, 2.0),
    ("billions of rows", "billions-of-rows", G::BigData, 3.0),
    ("大数据", "big-data", G::BigData, 2.0),
    ("海量", "large-dataset", G::BigData, 2.0),
    // visualisation
    ("matplotlib", "matplotlib", G::Viz, 1.5),
    ("seaborn", "seaborn", G::Viz, 1.5),
    ("plotly", "plotly", G::Viz, 1.5),
    ("chart", "chart", G::Viz, 1.0),
    ("charts", "chart", G::Viz, 1.0),
    ("bar chart", "chart", G::Viz, 1.0),
    ("plot", "chart", G::Viz, 1.0),
    ("histogram", "chart", G::Viz, 1.0),
    ("图表", "chart", G::Viz, 1.0),
    ("画图", "chart", G::Viz, 1.0),
    ("柱状图", "chart", G::Viz, 1.0),
    ("折线图", "chart", G::Viz, 1.0),
    ("可视化", "chart", G::Viz, 1.0),
    // classic machine learning
    ("sklearn", "sklearn", G::Ml, 2.0),
    ("scikit learn", "sklearn", G::Ml, 2.0),
    ("xgboost", "xgboost", G::Ml, 2.5),
    ("lightgbm", "lightgbm", G::Ml, 2.5),
    ("catboost", "catboost", G::Ml, 2.5),
    ("random forest", "random-forest", G::Ml, 2.0),
    ("regression", "regression", G::Ml, 1.0),
    ("classifier", "classifier", G::Ml, 1.0),
    ("grid search", "hyperparameter-search", G::Parallel, 2.0),
    ("hyperparameter", "hyperparameter-search", G::Parallel, 2.0),
    // cpu-heavy compute
    ("simulation", "simulation", G::Compute, 2.0),
    ("monte carlo", "monte-carlo", G::Compute, 2.0),
    ("ffmpeg", "ffmpeg", G::Compute, 2.5),
    ("transcode", "video", G::Compute, 2.0),
    ("video", "video", G::Compute, 1.0),
    ("render", "render", G::Compute, 1.0),
    ("blender", "render", G::Compute, 2.5),
    ("benchmark", "benchmark", G::Compute, 1.0),
    ("compress", "compress", G::Compute, 0.5),
    ("multiprocessing", "parallel", G::Parallel, 2.0),
    ("parallel", "parallel", G::Parallel, 1.5),
    ("all cores", "parallel", G::Parallel, 2.0),
    ("joblib", "parallel", G::Parallel, 1.0),
    ("并行", "parallel", G::Parallel, 1.5),
    ("仿真", "simulation", G::Compute, 2.0),
    ("蒙特卡洛", "monte-carlo", G::Compute, 2.0),
    ("转码", "video", G::Compute, 2.0),
    ("多进程", "parallel", G::Parallel, 2.0),
    // media (cost follows duration × resolution when both are known)
    ("ffmpeg", "media", G::Media, 1.0),
    ("transcode", "media", G::Media, 1.0),
    ("video", "media", G::Media, 1.0),
    ("videos", "media", G::Media, 1.0),
    ("clip", "media", G::Media, 1.0),
    ("gif", "media", G::Media, 1.0),
    ("mp4", "media", G::Media, 1.0),
    ("recording", "media", G::Media, 1.0),
    ("keynote", "media", G::Media, 1.0),
    ("视频", "media", G::Media, 1.0),
    ("转码", "media", G::Media, 1.0),
    ("mp3", "audio", G::Media, 1.0),
    ("wav", "audio", G::Media, 1.0),
    ("audio", "audio", G::Media, 1.0),
    ("podcast", "audio", G::Media, 1.0),
    ("音频", "audio", G::Media, 1.0),
    ("thumbnail", "thumbnail", G::Thumbnail, 1.0),
    ("thumbnails", "thumbnail", G::Thumbnail, 1.0),
    ("缩略图", "thumbnail", G::Thumbnail, 1.0),
    // readers whose memory does not grow with the data
    ("chunksize", "chunked", G::Stream, 1.5),
    ("chunk size", "chunked", G::Stream, 1.5),
    ("in chunks", "chunked", G::Stream, 1.5),
    ("chunked", "chunked", G::Stream, 1.5),
    ("分块", "chunked", G::Stream, 1.5),
    ("scan parquet", "lazy-scan", G::Stream, 1.5),
    ("scan csv", "lazy-scan", G::Stream, 1.5),
    ("scan ndjson", "lazy-scan", G::Stream, 1.5),
    ("lazyframe", "lazy-scan", G::Stream, 1.5),
    ("lazy", "lazy-scan", G::Stream, 1.5),
    ("惰性", "lazy-scan", G::Stream, 1.5),
    ("duckdb", "duckdb-engine", G::Stream, 1.5),
    ("sqlite", "sqlite-engine", G::Stream, 1.5),
    ("sqlite3", "sqlite-engine", G::Stream, 1.5),
    ("awk", "awk", G::Stream, 1.5),
    ("grep", "grep", G::Stream, 1.5),
    ("sed", "sed", G::Stream, 1.5),
    ("jq stream", "jq-stream", G::Stream, 1.5),
    ("line by line", "line-by-line", G::Stream, 1.5),
    ("streaming", "streaming", G::Stream, 1.5),
    ("stream the", "streaming", G::Stream, 1.5),
    ("逐行", "line-by-line", G::Stream, 1.5),
    ("流式", "streaming", G::Stream, 1.5),
    ("polars", "polars", G::Threaded, 0.0),
    ("duckdb", "duckdb", G::Threaded, 0.0),
    ("s3", "remote-data", G::Remote, 0.0),
    ("httpfs", "remote-data", G::Remote, 0.0),
    ("gcs", "remote-data", G::Remote, 0.0),
    ("into memory", "in-memory", G::InMemory, 0.0),
    ("fully into", "in-memory", G::InMemory, 0.0),
    ("eagerly", "in-memory", G::InMemory, 0.0),
    ("全部读入", "in-memory", G::InMemory, 0.0),
    ("一次性读入", "in-memory", G::InMemory, 0.0),
    ("全量读入", "in-memory", G::InMemory, 0.0),
    // test runners
    ("pytest", "pytest", G::Tests, 1.0),
    ("jest", "js-test-runner", G::Build, 1.0),
    ("vitest", "js-test-runner", G::Build, 1.0),
    ("mocha", "js-test-runner", G::Build, 1.0),
    ("karma", "js-test-runner", G::Build, 1.0),
    // builds
    ("mvn", "maven", G::Jvm, 3.0),
    ("maven", "maven", G::Jvm, 3.0),
    ("gradle", "gradle", G::Jvm, 3.0),
    ("gradlew", "gradle", G::Jvm, 3.0),
    ("sbt", "sbt", G::Jvm, 3.0),
    ("javac", "javac", G::Jvm, 3.0),
    ("spring boot", "spring-boot", G::Jvm, 1.0),
    ("npm install", "npm-install", G::Build, 1.5),
    ("npm ci", "npm-install", G::Build, 1.5),
    ("yarn install", "npm-install", G::Build, 1.5),
    ("pnpm install", "npm-install", G::Build, 1.5),
    ("npm run build", "npm-build", G::Build, 2.5),
    ("yarn build", "npm-build", G::Build, 2.5),
    ("pnpm build", "npm-build", G::Build, 2.5),
    ("webpack", "webpack", G::Build, 2.5),
    ("vite build", "vite", G::Build, 2.5),
    ("rollup", "rollup", G::Build, 2.0),
    ("esbuild", "esbuild", G::Build, 2.0),
    ("tsc", "typescript-compile", G::Build, 1.5),
    ("cargo build", "cargo-build", G::Build, 3.0),
    ("cargo test", "cargo-build", G::Build, 3.0),
    ("go build", "go-build", G::Build, 3.0),
    ("go test", "go-build", G::Build, 3.0),
    ("ng build", "angular-build", G::Build, 2.5),
    ("with make", "make", G::Build, 2.5),
    ("cmake", "cmake", G::Build, 3.0),
    ("makefile", "make", G::Build, 2.0),
    ("make j", "make", G::Build, 2.5),
    ("make all", "make", G::Build, 2.5),
    ("make install", "make", G::Build, 2.5),
    ("run make", "make", G::Build, 2.5),
    ("ninja", "ninja", G::Build, 2.5),
    ("bazel", "bazel", G::Build, 3.0),
    ("gcc", "gcc", G::Build, 2.0),
    ("g++", "gcc", G::Build, 2.0),
    ("clang", "clang", G::Build, 2.0),
    ("compile", "compile", G::Build, 2.0),
    ("compiles", "compile", G::Build, 2.0),
    ("compiling", "compile", G::Build, 2.0),
    ("compilation", "compile", G::Build, 2.0),
    ("build the project", "build", G::Build, 1.5),
    ("build frontend", "build", G::Build, 1.5),
    ("build the frontend", "build", G::Build, 1.5),
    ("docker build", "docker-build", G::Build, 2.0),
    ("编译", "compile", G::Build, 2.5),
    ("构建", "build", G::Build, 1.5),
    ("monorepo", "monorepo", G::Monorepo, 2.0),
    ("turborepo", "turborepo", G::Monorepo, 2.0),
    ("lerna", "lerna", G::Monorepo, 2.0),
    ("nx", "nx", G::Monorepo, 1.5),
    ("workspaces", "workspaces", G::Monorepo, 1.0),
    ("large codebase", "large-codebase", G::Monorepo, 2.0),
    ("large repo", "large-codebase", G::Monorepo, 2.0),
    ("large repository", "large-codebase", G::Monorepo, 2.0),
    ("大仓库", "large-codebase", G::Monorepo, 2.0),
    // browsers
    ("playwright", "playwright", G::Browser, 3.0),
    ("puppeteer", "puppeteer", G::Browser, 3.0),
    ("selenium", "selenium", G::Browser, 3.0),
    ("webdriver", "selenium", G::Browser, 3.0),
    ("cypress", "cypress", G::Browser, 3.0),
    ("chromium", "chromium", G::Browser, 3.0),
    ("chrome", "chromium", G::Browser, 2.0),
    ("firefox", "firefox", G::Browser, 2.0),
    ("headless", "headless", G::Browser, 2.0),
    ("screenshot", "screenshot", G::Browser, 2.0),
    ("screenshots", "screenshot", G::Browser, 2.0),
    ("lighthouse", "lighthouse", G::Browser, 2.0),
    ("browser", "browser", G::Browser, 2.0),
    ("web page", "web-page", G::Browser, 1.0),
    ("webpage", "web-page", G::Browser, 1.0),
    ("浏览器", "browser", G::Browser, 2.0),
    ("截图", "screenshot", G::Browser, 2.0),
    ("网页", "web-page", G::Browser, 1.0),
    // gpu
    ("cuda", "cuda", G::Gpu, 3.0),
    ("gpu", "gpu", G::Gpu, 3.0),
    ("gpus", "gpu", G::Gpu, 3.0),
    ("nvidia", "gpu", G::Gpu, 3.0),
    ("fine tune", "fine-tune", G::GpuWork, 3.0),
    ("fine tuning", "fine-tune", G::GpuWork, 3.0),
    ("finetune", "fine-tune", G::GpuWork, 3.0),
    ("finetuning", "fine-tune", G::GpuWork, 3.0),
    ("lora", "lora", G::GpuWork, 2.5),
    ("qlora", "lora", G::GpuWork, 2.5),
    ("显卡", "gpu", G::Gpu, 3.0),
    ("微调", "fine-tune", G::GpuWork, 3.0),
    ("torch", "torch", G::DeepLearning, 1.5),
    ("pytorch", "torch", G::DeepLearning, 1.5),
    ("tensorflow", "tensorflow", G::DeepLearning, 1.5),
    ("keras", "tensorflow", G::DeepLearning, 1.0),
    ("jax", "jax", G::DeepLearning, 1.5),
    ("transformers", "transformers", G::DeepLearning, 1.5),
    ("neural network", "neural-network", G::DeepGeneric, 1.5),
    ("neural net", "neural-network", G::DeepGeneric, 1.5),
    ("deep learning", "deep-learning", G::DeepGeneric, 1.5),
    ("llm", "llm", G::DeepLearning, 1.0),
    ("bert", "transformer-model", G::DeepLearning, 1.0),
    ("resnet", "transformer-model", G::DeepLearning, 1.0),
    ("diffusion", "diffusion", G::DeepLearning, 1.0),
    ("深度学习", "deep-learning", G::DeepGeneric, 1.5),
    ("神经网络", "neural-network", G::DeepGeneric, 1.5),
    // toy scale
    ("toy", "toy", G::Toy, 1.0),
    ("xor", "toy", G::Toy, 1.0),
    ("iris", "toy", G::Toy, 1.0),
    ("from scratch", "toy", G::Toy, 1.0),
    ("从零", "toy", G::Toy, 1.0),
    ("玩具", "toy", G::Toy, 1.0),
    ("train", "train", G::Train, 1.0),
    ("training", "train", G::Train, 1.0),
    ("trains", "train", G::Train, 1.0),
    ("pretrain", "train", G::Train, 1.0),
    ("训练", "train", G::Train, 1.0),
    // negations
    ("no gpu", "no-gpu", G::NoGpu, 1.0),
    ("without gpu", "no-gpu", G::NoGpu, 1.0),
    ("without a gpu", "no-gpu", G::NoGpu, 1.0),
    ("cpu only", "no-gpu", G::NoGpu, 1.0),
    ("on cpu", "no-gpu", G::NoGpu, 1.0),
    ("on the cpu", "no-gpu", G::NoGpu, 1.0),
    ("不需要gpu", "no-gpu", G::NoGpu, 1.0),
    ("不用gpu", "no-gpu", G::NoGpu, 1.0),
    ("no browser", "no-browser", G::NoBrowser, 1.0),
    ("without a browser", "no-browser", G::NoBrowser, 1.0),
    ("without browser", "no-browser", G::NoBrowser, 1.0),
    // network needs
    ("pip install", "pip-install", G::FetchPypi, 1.0),
    ("pypi", "pip-install", G::FetchPypi, 1.0),
    ("requirements txt", "pip-install", G::FetchPypi, 1.0),
    ("uv pip", "pip-install", G::FetchPypi, 1.0),
    ("npm", "npm", G::FetchOpen, 1.0),
    ("yarn", "npm", G::FetchOpen, 1.0),
    ("pnpm", "npm", G::FetchOpen, 1.0),
    ("git clone", "git-clone", G::FetchOpen, 1.0),
    ("clone", "git-clone", G::FetchOpen, 1.0),
    ("curl", "download", G::FetchOpen, 1.0),
    ("wget", "download", G::FetchOpen, 1.0),
    ("download", "download", G::FetchOpen, 1.0),
    ("http", "url", G::FetchOpen, 1.0),
    ("https", "url", G::FetchOpen, 1.0),
    ("website", "url", G::FetchOpen, 1.0),
    ("scrape", "download", G::FetchOpen, 1.0),
    ("下载", "download", G::FetchOpen, 1.0),
];

/// One matched keyword, by its canonical id.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Signal {
    pub id: String,
    pub weight: f64,
}

/// What the heuristic and the signature read from a context.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Features {
    pub kind: WorkloadKind,
    pub needs_gpu: bool,
    /// Matched signals, strongest first, one per id.
    pub signals: Vec<Signal>,
    /// Data volume (explicit `data_size_mb`, or from the text; rows are
    /// counted at 100 bytes each).
    pub data_mb: f64,
    pub repo_mb: f64,
    pub workspace_mb: f64,
    /// A memory amount the text asks for (`needs 32 GB RAM`).
    pub memory_hint_mb: f64,
    pub duration_s: f64,
    /// Score of each kind (after explicit flags and negations).
    pub browser_score: f64,
    pub build_score: f64,
    pub data_score: f64,
    pub compute_score: f64,
    pub gpu_score: f64,
    pub trivial_score: f64,
    pub(crate) ml: f64,
    pub(crate) efficient: f64,
    pub(crate) distributed: f64,
    pub(crate) big_data: f64,
    pub(crate) parallel: f64,
    pub(crate) jvm: f64,
    pub(crate) monorepo: f64,
    pub(crate) fetch_pypi: bool,
    pub(crate) fetch_open: bool,
    /// How the data is read; decides memory per byte of data.
    pub reader: Reader,
    /// The data stays remote (S3, httpfs) and is streamed: no local disk.
    pub remote_data: bool,
    /// Audio/video work with a known duration.
    pub media: Option<MediaWork>,
    /// Test files a runner will go through (`600 test files`).
    pub test_files: f64,
    /// What the text said that was *not* taken as work, and why (for the
    /// reason and the trace).
    pub notes: Vec<String>,
}

/// How data is read, which decides memory per byte of data.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reader {
    /// pandas & co.: about 2.5× the data in memory.
    InMemory,
    /// Eager Arrow-based readers (polars `read_*`, pyarrow): about 1.5×.
    Arrow,
    /// `.xlsx` through openpyxl: many times the (compressed) file.
    Excel,
    /// Chunked, lazy, database or line-by-line readers: memory independent
    /// of the data; `threaded` engines (polars, DuckDB) use a few cores.
    Streaming { threaded: bool },
    /// Out-of-core engines (Spark, Dask, Ray).
    Distributed,
}

impl Reader {
    pub fn describe(self) -> &'static str {
        match self {
            Reader::InMemory => "in-memory reader (≈2.5× the data)",
            Reader::Arrow => "eager Arrow reader (≈1.5× the data)",
            Reader::Excel => "xlsx reader (≈5× the file)",
            Reader::Streaming { threaded: true } => {
                "streaming multi-threaded engine (memory independent of the data)"
            }
            Reader::Streaming { threaded: false } => {
                "streaming reader (memory independent of the data)"
            }
            Reader::Distributed => "out-of-core engine (≈1× the data, spills)",
        }
    }
}

/// Audio/video work whose duration is known.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MediaWork {
    /// Seconds of media.
    pub seconds: f64,
    /// Cost per second relative to 1080p video (480p 0.25, 4K 4, audio 0.05;
    /// thumbnails only decode a few frames: ×0.1).
    pub factor: f64,
}

impl MediaWork {
    /// Seconds of 1080p-equivalent transcoding.
    pub fn units(&self) -> f64 {
        self.seconds * self.factor
    }
}

const ROW_BYTES: f64 = 100.0;
const MAX_QUANTITY_MB: f64 = 1e12;

impl Features {
    /// Reads every text and number field of `ctx`. Never panics; works on
    /// unvalidated input too (numbers are sanitized).
    pub fn extract(ctx: &TaskContext) -> Features {
        let mut notes: Vec<String> = Vec::new();
        // Text of the clauses read as work, for quantities.
        let mut lower = String::with_capacity(ctx.task.len() + 256);
        let mut found: Vec<(&str, Group, f64)> = Vec::new();
        for cl in untrusted::clauses(ctx) {
            match cl.role {
                ClauseRole::Directive => {
                    notes.push(format!(
                        "ignored {} «{}»: addressed to the planner ({}), text is data",
                        cl.field,
                        excerpt(&cl.lower, 60),
                        cl.marker
                    ));
                    continue;
                }
                ClauseRole::Mention => {
                    notes.push(format!(
                        "ignored {} «{}»: about tools, not running them ({})",
                        cl.field,
                        excerpt(&cl.lower, 60),
                        cl.marker
                    ));
                    continue;
                }
                ClauseRole::Artifact | ClauseRole::Work => {}
            }
            let norm = normalize(&cl.lower);
            let mut suppressed: Vec<&str> = Vec::new();
            for &(pat, id, group, weight) in KEYWORDS {
                let hit = if pat.is_ascii() {
                    contains_phrase(&norm, pat)
                } else {
                    cl.lower.contains(pat)
                };
                if !hit {
                    continue;
                }
                if cl.role == ClauseRole::Artifact && TOOL_GROUPS.contains(&group) {
                    suppressed.push(id);
                    continue;
                }
                if id == "compile"
                    && NOT_CODE.iter().any(|w| {
                        contains_phrase(&norm, w) || (!w.is_ascii() && cl.lower.contains(w))
                    })
                {
                    suppressed.push(id);
                    continue;
                }
                match found.iter_mut().find(|(i, g, _)| *i == id && *g == group) {
                    Some(e) => e.2 = e.2.max(weight),
                    None => found.push((id, group, weight)),
                }
            }
            if !suppressed.is_empty() {
                suppressed.dedup();
                notes.push(format!(
                    "{} «{}» names {} without running it",
                    cl.field,
                    excerpt(&cl.lower, 60),
                    suppressed.join(", ")
                ));
            }
            lower.push_str(&cl.lower);
            lower.push('\n');
        }
        // Languages are weak hints: Java/Scala/C/C++/Rust usually mean a build.
        for lang in &ctx.languages {
            let l = lang.trim().to_lowercase();
            let hint = match l.as_str() {
                "java" | "scala" | "kotlin" => Some(("jvm", G::Jvm, 1.0)),
                "c" | "c++" | "cpp" | "rust" => Some(("native", G::Build, 1.0)),
                _ => None,
            };
            if let Some((id, g, w)) = hint {
                if !found.iter().any(|(i, gg, _)| *i == id && *gg == g) {
                    found.push((id, g, w));
                }
            }
        }
        let score = |g: Group| -> f64 {
            found
                .iter()
                .filter(|(_, gg, _)| *gg == g)
                .map(|(_, _, w)| *w)
                .sum()
        };
        let has = |g: Group| found.iter().any(|(_, gg, _)| *gg == g);

        let q = parse_quantities(&lower);
        let data_mb = sane(ctx.data_size_mb)
            .max(q.data_mb)
            .max(q.rows * ROW_BYTES / 1e6);
        let repo_mb = sane(ctx.repo_size_mb).max(q.repo_mb);

        let reader = if score(G::Distributed) > 0.0 {
            Reader::Distributed
        } else if has(G::Stream) && !has(G::InMemory) {
            Reader::Streaming {
                threaded: has(G::Threaded),
            }
        } else if found.iter().any(|(i, _, _)| *i == "excel") && data_mb >= 50.0 {
            Reader::Excel
        } else if score(G::Efficient) > 0.0 && !found.iter().any(|(i, _, _)| *i == "pandas") {
            Reader::Arrow
        } else {
            Reader::InMemory
        };
        let remote_data = has(G::Remote) && matches!(reader, Reader::Streaming { .. });

        let media = if has(G::Media) {
            parse_media(&lower, has(G::Thumbnail))
        } else {
            None
        };
        let test_files = parse_test_files(&lower);

        let no_gpu = score(G::NoGpu) > 0.0;
        let gpu_word = score(G::Gpu);
        let gpu_work = score(G::GpuWork);
        let dl = score(G::DeepLearning) + score(G::DeepGeneric);
        let train = score(G::Train);
        let toy = has(G::Toy) || (data_mb > 0.0 && data_mb < 10.0);
        // A GPU word alone (a version check, a news item) is not work; it
        // takes fine-tuning, training a non-toy deep model, or a GPU word
        // next to deep-learning work.
        let inferred_gpu = !no_gpu
            && (gpu_work > 0.0
                || (dl > 0.0 && train > 0.0 && !toy)
                || (gpu_word > 0.0 && (dl > 0.0 || train > 0.0)));
        let needs_gpu = match ctx.needs_gpu {
            Some(b) => b,
            None => inferred_gpu,
        };
        if ctx.needs_gpu.is_none() && !needs_gpu && dl > 0.0 && train > 0.0 && toy {
            notes.push("deep-learning words on toy-sized data: no GPU".into());
        }
        let gpu_score = if needs_gpu {
            gpu_word
                + gpu_work
                + dl
                + train
                + if ctx.needs_gpu == Some(true) {
                    3.0
                } else {
                    0.0
                }
        } else {
            0.0
        };

        let mut browser_score = score(G::Browser);
        if score(G::NoBrowser) > 0.0 || ctx.needs_browser == Some(false) {
            browser_score = 0.0;
        }
        if ctx.needs_browser == Some(true) {
            browser_score += 3.0;
        }

        let jvm = score(G::Jvm);
        let monorepo = score(G::Monorepo);
        let mut build_score =
            score(G::Build) + jvm + if monorepo > 0.0 { monorepo * 0.5 } else { 0.0 };
        if ctx.needs_compile == Some(false) {
            build_score = 0.0;
        }
        if ctx.needs_compile == Some(true) {
            build_score += 3.0;
        }

        let ml = score(G::Ml);
        let efficient = score(G::Efficient);
        let distributed = score(G::Distributed);
        let big_data = score(G::BigData);
        let data_score = score(G::Data)
            + ml
            + efficient
            + distributed
            + big_data
            + score(G::Viz)
            + score(G::Stream);
        let parallel = score(G::Parallel);
        let compute_score = score(G::Compute) + parallel;
        let trivial_score = score(G::Trivial);

        let kind = if needs_gpu {
            WorkloadKind::Gpu
        } else if browser_score >= 2.0 {
            WorkloadKind::Browser
        } else if build_score >= 2.0 {
            WorkloadKind::Build
        } else if compute_score >= 2.0 && compute_score > data_score {
            WorkloadKind::Compute
        } else if data_score >= 1.5 || (data_score > 0.0 && data_mb > 0.0) {
            WorkloadKind::Data
        } else if compute_score >= 2.0 {
            WorkloadKind::Compute
        } else {
            WorkloadKind::Script
        };

        let mut signals: Vec<Signal> = Vec::new();
        for (id, group, w) in &found {
            if matches!(
                group,
                G::NoGpu
                    | G::NoBrowser
                    | G::FetchPypi
                    | G::FetchOpen
                    | G::Threaded
                    | G::Remote
                    | G::InMemory
                    | G::Media
                    | G::Thumbnail
            ) {
                continue;
            }
            match signals.iter_mut().find(|s| s.id == *id) {
                Some(s) => s.weight = s.weight.max(*w),
                None => signals.push(Signal {
                    id: (*id).to_string(),
                    weight: *w,
                }),
            }
        }
        signals.sort_by(|a, b| b.weight.total_cmp(&a.weight).then_with(|| a.id.cmp(&b.id)));

        Features {
            kind,
            needs_gpu,
            signals,
            data_mb,
            repo_mb,
            workspace_mb: sane(ctx.workspace_mb),
            memory_hint_mb: q.memory_mb,
            duration_s: sane(ctx.expected_duration_s),
            browser_score,
            build_score,
            data_score,
            compute_score,
            gpu_score,
            trivial_score,
            ml,
            efficient,
            distributed,
            big_data,
            parallel,
            jvm,
            monorepo,
            fetch_pypi: score(G::FetchPypi) > 0.0,
            fetch_open: score(G::FetchOpen) > 0.0,
            reader,
            remote_data,
            media,
            test_files,
            notes,
        }
    }

    /// The score of the chosen kind: how strongly the context says so.
    pub fn kind_strength(&self) -> f64 {
        match self.kind {
            WorkloadKind::Script => self.trivial_score,
            WorkloadKind::Data => self.data_score,
            WorkloadKind::Compute => self.compute_score,
            WorkloadKind::Build => self.build_score,
            WorkloadKind::Browser => self.browser_score,
            WorkloadKind::Gpu => self.gpu_score,
        }
    }

    /// The strongest score among the kinds that were *not* chosen.
    pub(crate) fn runner_up_strength(&self) -> f64 {
        let all = [
            (WorkloadKind::Data, self.data_score),
            (WorkloadKind::Compute, self.compute_score),
            (WorkloadKind::Build, self.build_score),
            (WorkloadKind::Browser, self.browser_score),
        ];
        all.iter()
            .filter(|(k, _)| *k != self.kind)
            .map(|(_, s)| *s)
            .fold(0.0, f64::max)
    }

    /// The normalized feature set the signature is made of: kind, GPU need,
    /// the strong signals (libraries and tools, weight ≥ 1.5; common words
    /// are left out so rephrasings match) and log2 buckets of the volumes.
    pub fn normalized(&self) -> String {
        let strong: BTreeSet<&str> = self
            .signals
            .iter()
            .filter(|s| s.weight >= 1.5)
            .map(|s| s.id.as_str())
            .collect();
        let strong: Vec<&str> = strong.into_iter().collect();
        format!(
            "v1|kind={}|gpu={}|signals={}|data={}|repo={}|mem={}",
            self.kind,
            self.needs_gpu,
            strong.join(","),
            bucket(self.data_mb),
            bucket(self.repo_mb),
            bucket(self.memory_hint_mb),
        )
    }

    /// `ws-` + 16 hex digits of SHA-256 over [`Features::normalized`].
    pub fn signature(&self) -> String {
        let digest = Sha256::digest(self.normalized().as_bytes());
        format!("ws-{}", &hex::encode(digest)[..16])
    }
}

/// The workload signature of a context: similar work (same kind, same strong
/// signals, same order of magnitude of data and repository) shares it.
pub fn workload_signature(ctx: &TaskContext) -> String {
    Features::extract(ctx).signature()
}

/// Groups that stand for running a tool; a clause that only reads what a
/// tool produced does not need the tool.
const TOOL_GROUPS: &[Group] = &[
    G::Browser,
    G::Build,
    G::Jvm,
    G::Monorepo,
    G::Gpu,
    G::GpuWork,
    G::DeepLearning,
    G::Distributed,
];

/// Objects of "compile" that are not code.
const NOT_CODE: &[&str] = &[
    "list",
    "reading list",
    "bibliography",
    "summary",
    "notes",
    "glossary",
    "regex",
    "regular expression",
    "pattern",
    "正则",
    "清单",
    "列表",
    "资料",
];

/// Seconds of media and its cost factor, from `10 seconds`, `3-minute`,
/// `2-hour`, `90 分钟`, `30 秒` and resolutions (`480p` … `4k`, `8k`).
fn parse_media(lower: &str, thumbnails: bool) -> Option<MediaWork> {
    let norm = normalize(lower);
    let toks: Vec<&str> = norm.split_whitespace().collect();
    let mut seconds: f64 = 0.0;
    for (i, t) in toks.iter().enumerate() {
        // a number glued to a CJK unit ("90分钟") or followed by a unit word
        let (num, glued) = match t.find(|c: char| !c.is_ascii_digit() && c != '.') {
            Some(0) => continue,
            Some(k) => (&t[..k], &t[k..]),
            None => (*t, ""),
        };
        let Ok(v) = num.parse::<f64>() else { continue };
        let unit = if glued.is_empty() {
            toks.get(i + 1).copied().unwrap_or("")
        } else {
            glued
        };
        let mult = match unit {
            "second" | "seconds" | "sec" | "secs" | "s" => 1.0,
            "minute" | "minutes" | "min" | "mins" => 60.0,
            "hour" | "hours" | "hr" | "hrs" | "h" => 3600.0,
            u if u.starts_with('秒') => 1.0,
            u if u.starts_with("分钟") => 60.0,
            u if u.starts_with("小时") => 3600.0,
            _ => continue,
        };
        seconds = seconds.max(v * mult);
    }
    if seconds <= 0.0 {
        return None;
    }
    let mut factor: f64 = 0.0;
    for (pat, f) in [
        ("480p", 0.25),
        ("360p", 0.15),
        ("720p", 0.5),
        ("1080p", 1.0),
        ("1440p", 2.0),
        ("2160p", 4.0),
        ("4k", 4.0),
        ("8k", 16.0),
    ] {
        if contains_phrase(&norm, pat) {
            factor = factor.max(f);
        }
    }
    if factor == 0.0 {
        let audio_only = ["mp3", "wav", "audio", "podcast", "flac", "aac"]
            .iter()
            .any(|w| contains_phrase(&norm, w))
            && !["video", "mp4", "clip", "gif", "mkv"]
                .iter()
                .any(|w| contains_phrase(&norm, w));
        factor = if audio_only || lower.contains("音频") {
            0.05
        } else {
            1.0
        };
    }
    if thumbnails {
        factor *= 0.1;
    }
    Some(MediaWork { seconds, factor })
}

/// The number of test files a runner goes through (`600 test files`,
/// `900 test suites`, `500 个测试文件`); 0 when not said.
fn parse_test_files(lower: &str) -> f64 {
    let norm = normalize(lower);
    let toks: Vec<&str> = norm.split_whitespace().collect();
    let mut n: f64 = 0.0;
    for (i, t) in toks.iter().enumerate() {
        let Ok(v) = t.parse::<f64>() else { continue };
        let next = toks.get(i + 1).copied().unwrap_or("");
        let next2 = toks.get(i + 2).copied().unwrap_or("");
        let english = matches!(next, "test" | "spec")
            && matches!(next2, "files" | "suites" | "modules")
            || matches!(next, "tests" | "specs");
        let chinese = next.starts_with("个测试");
        if english || chinese {
            n = n.max(v);
        }
    }
    n
}

fn sane(v: Option<f64>) -> f64 {
    match v {
        Some(x) if x.is_finite() && x > 0.0 => x.min(MAX_QUANTITY_MB),
        _ => 0.0,
    }
}

/// log2 bucket of a size in MB; 0 for nothing.
fn bucket(mb: f64) -> i32 {
    if mb.is_finite() && mb >= 1.0 {
        mb.log2().floor().clamp(0.0, 60.0) as i32 + 1
    } else {
        0
    }
}

fn is_cjk(c: char) -> bool {
    !c.is_ascii() && c.is_alphanumeric()
}

/// Lowercase text with punctuation turned into single spaces (except `+`,
/// kept for `g++`/`c++`), a space between ASCII and non-ASCII runs, and a
/// leading and trailing space so phrases match on word boundaries.
fn normalize(lower: &str) -> String {
    let mut out = String::with_capacity(lower.len() + 2);
    out.push(' ');
    let mut prev: Option<char> = None;
    for c in lower.chars() {
        let keep = c.is_ascii_alphanumeric() || c == '+' || is_cjk(c);
        if keep {
            if let Some(p) = prev {
                if p != ' ' && (is_cjk(p) != is_cjk(c)) {
                    out.push(' ');
                }
            }
            out.push(c);
            prev = Some(c);
        } else if prev != Some(' ') {
            out.push(' ');
            prev = Some(' ');
        }
    }
    if prev != Some(' ') {
        out.push(' ');
    }
    out
}

fn contains_phrase(norm: &str, phrase: &str) -> bool {
    let mut needle = String::with_capacity(phrase.len() + 2);
    needle.push(' ');
    needle.push_str(phrase);
    needle.push(' ');
    norm.contains(&needle)
}

#[derive(Default, Debug)]
struct Quantities {
    data_mb: f64,
    repo_mb: f64,
    memory_mb: f64,
    rows: f64,
}

const REPO_WORDS: &[&str] = &[
    "repo",
    "repository",
    "monorepo",
    "codebase",
    "checkout",
    "clone",
    "source tree",
    "仓库",
    "代码",
];
const MEMORY_WORDS: &[&str] = &["ram", "memory", "内存", "of ram", "heap"];
const ROW_WORDS: &[&str] = &[
    "rows", "row", "records", "record", "lines", "entries", "samples", "events", "行", "条", "样本",
];

/// Finds `<number> <unit>` pairs. Sizes (kb..pb) become MB; counts with a
/// multiplier (k, million, 万, 亿) or a row word become rows.
fn parse_quantities(lower: &str) -> Quantities {
    let chars: Vec<char> = lower.chars().collect();
    let mut q = Quantities::default();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if !c.is_ascii_digit() {
            i += 1;
            continue;
        }
        // Digits glued to a word (python3, s3, h264) are names, not amounts.
        if i > 0 && (chars[i - 1].is_ascii_alphabetic() || chars[i - 1] == '.') {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
            continue;
        }
        let start = i;
        let mut num = String::new();
        while i < chars.len() {
            let ch = chars[i];
            if ch.is_ascii_digit() {
                num.push(ch);
            } else if ch == ',' && i + 1 < chars.len() && chars[i + 1].is_ascii_digit() {
                // thousands separator
            } else if ch == '.'
                && i + 1 < chars.len()
                && chars[i + 1].is_ascii_digit()
                && !num.contains('.')
            {
                num.push('.');
            } else {
                break;
            }
            i += 1;
            if num.len() > 30 {
                break;
            }
        }
        let value: f64 = match num.parse::<f64>() {
            Ok(v) if v.is_finite() => v,
            _ => continue,
        };
        // the unit: after at most one space, a run of ASCII letters or CJK chars
        let mut j = i;
        if j < chars.len() && chars[j] == ' ' {
            j += 1;
        }
        let unit_start = j;
        if j < chars.len() && chars[j].is_ascii_alphabetic() {
            while j < chars.len() && chars[j].is_ascii_alphabetic() && j - unit_start < 12 {
                j += 1;
            }
        } else {
            while j < chars.len() && is_cjk(chars[j]) && j - unit_start < 4 {
                j += 1;
            }
        }
        let unit: String = chars[unit_start..j].iter().collect();
        let after: String = chars[j..chars.len().min(j + 16)].iter().collect();
        let before: String = chars[start.saturating_sub(48)..start].iter().collect();

        let size_mb = match unit.as_str() {
            "kb" | "kib" => Some(value / 1024.0),
            "mb" | "mib" => Some(value),
            "gb" | "gib" | "g" => Some(value * 1024.0),
            "tb" | "tib" | "t" => Some(value * 1024.0 * 1024.0),
            "pb" | "pib" => Some(value * 1024.0 * 1024.0 * 1024.0),
            _ => None,
        };
        if let Some(mb) = size_mb {
            let mb = mb.min(MAX_QUANTITY_MB);
            if MEMORY_WORDS
                .iter()
                .any(|w| after.trim_start().starts_with(w))
            {
                q.memory_mb = q.memory_mb.max(mb);
            } else if REPO_WORDS
                .iter()
                .any(|w| before.contains(w) || after.contains(w))
            {
                q.repo_mb = q.repo_mb.max(mb);
            } else {
                q.data_mb = q.data_mb.max(mb);
            }
            i = j.max(i);
            continue;
        }
        // counts: a multiplier (possibly a CJK prefix of the row word)
        let (mult, rest) = count_multiplier(&unit);
        let tail = format!("{rest}{after}");
        let tail = tail.trim_start();
        let row_word = ROW_WORDS.iter().any(|w| tail.starts_with(w));
        if mult > 1.0 || row_word {
            let rows = (value * mult).min(1e15);
            if row_word || rows >= 1e5 {
                q.rows = q.rows.max(rows);
            }
        }
        i = j.max(i);
    }
    q
}

/// The multiplier a unit word stands for, and what follows it inside the
/// same token (for `万行` → 1e4 and `行`).
fn count_multiplier(unit: &str) -> (f64, &str) {
    for (prefix, m) in [
        ("百万", 1e6),
        ("千万", 1e7),
        ("万", 1e4),
        ("亿", 1e8),
        ("千", 1e3),
    ] {
        if let Some(rest) = unit.strip_prefix(prefix) {
            return (m, rest);
        }
    }
    match unit {
        "k" | "thousand" => (1e3, ""),
        "m" | "mm" | "mn" | "mio" | "million" | "millions" => (1e6, ""),
        "bn" | "billion" | "billions" => (1e9, ""),
        _ => (1.0, unit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(task: &str) -> TaskContext {
        TaskContext::new(task)
    }

    #[test]
    fn normalize_breaks_ascii_and_cjk_runs() {
        assert_eq!(
            normalize("用playwright检查网页"),
            " 用 playwright 检查网页 "
        );
        assert_eq!(normalize("fine-tune, g++!"), " fine tune g++ ");
    }

    #[test]
    fn quantities_with_units_are_parsed() {
        let q = parse_quantities("load a 20 gb csv with 10 million rows");
        assert_eq!(q.data_mb, 20480.0);
        assert_eq!(q.rows, 1e7);
        let q = parse_quantities("处理1000万行数据, 3.5gib parquet");
        assert_eq!(q.rows, 1e7);
        assert_eq!(q.data_mb, 3.5 * 1024.0);
        let q = parse_quantities("clone the 4 gb monorepo; needs 32gb ram");
        assert_eq!(q.repo_mb, 4096.0);
        assert_eq!(q.memory_mb, 32768.0);
        assert_eq!(q.data_mb, 0.0);
        let q = parse_quantities("python3.11 and s3 and 1,500,000 records and 500k rows");
        assert_eq!(q.rows, 1_500_000.0);
        let q = parse_quantities("print 1 + 1");
        assert_eq!((q.data_mb, q.rows), (0.0, 0.0));
    }

    #[test]
    fn python_alone_says_nothing_about_size() {
        let mut a = ctx("run the script");
        a.languages = vec!["python".into()];
        let f = Features::extract(&a);
        assert_eq!(f.kind, WorkloadKind::Script);
        let mut b = ctx("import pandas; df = pd.read_csv('20GB.csv')");
        b.languages = vec!["python".into()];
        let f = Features::extract(&b);
        assert_eq!(f.kind, WorkloadKind::Data);
        assert_eq!(f.data_mb, 20480.0);
    }

    #[test]
    fn gpu_needs_a_hard_signal_or_training_a_deep_model() {
        assert!(Features::extract(&ctx("fine-tune llama with LoRA")).needs_gpu);
        assert!(Features::extract(&ctx("train a resnet with pytorch")).needs_gpu);
        assert!(!Features::extract(&ctx("run torch inference")).needs_gpu);
        assert!(!Features::extract(&ctx("train a pytorch model on CPU only")).needs_gpu);
        let mut c = ctx("fine-tune bert");
        c.needs_gpu = Some(false);
        assert!(!Features::extract(&c).needs_gpu);
    }

    #[test]
    fn signature_ignores_wording_but_not_scale() {
        let a = workload_signature(&ctx("Load the Excel file and compute the sales stats"));
        let b = workload_signature(&ctx("统计 Excel 销售数据"));
        assert_eq!(a, b);
        assert!(a.starts_with("ws-") && a.len() == 19, "{a}");
        let small = workload_signature(&ctx("pandas job over a 20 GB csv"));
        let similar = workload_signature(&ctx("use pandas to clean a 25GB CSV file"));
        let big = workload_signature(&ctx("pandas job over a 200 GB csv"));
        assert_eq!(small, similar);
        assert_ne!(small, big);
    }
}

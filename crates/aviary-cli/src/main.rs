//! `aviary`: one binary for the server and every client command (DESIGN §7).
//!
//! Client commands talk to `AVIARY_URL` (default `http://127.0.0.1:7400`)
//! with `AVIARY_API_KEY` (default: the admin key in `<data dir>/admin.key`).
//! `run` and `sandbox exec` exit with the command's own exit code; failures of
//! Aviary itself exit with the documented codes of `ErrorCode::cli_exit_code`.
#![forbid(unsafe_code)]

mod cli;
mod output;
mod progress;
mod telemetry;

use clap::Parser;

fn main() {
    let args = cli::Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aviary: cannot start async runtime: {e}");
            std::process::exit(70);
        }
    };
    let code = rt.block_on(cli::run(args));
    std::process::exit(code);
}

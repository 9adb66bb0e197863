//! Logs and (optional) OpenTelemetry traces of `serve` and `node`.
//!
//! Logs go to stderr: `AVIARY_LOG` filters them (`info` by default),
//! `AVIARY_LOG_FORMAT=json` writes one JSON object a line, colours only on a
//! terminal. Traces are off unless an OTLP endpoint is configured with the
//! standard variables: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (OTLP over HTTP; `OTEL_EXPORTER_OTLP_PROTOCOL`
//! `http/protobuf`, the default, or `http/json`; the batch settings
//! `OTEL_BSP_*` apply). Every API request is one span (`http.request`, see
//! `aviary-server`'s router) whose `aviary.request_id` attribute is the
//! request id the answer's `x-request-id` and the events carry.

use std::sync::OnceLock;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The trace pipeline, kept to flush it at exit.
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Whether an OTLP endpoint is configured.
fn otlp_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// The OTLP exporter's protocol from `OTEL_EXPORTER_OTLP_PROTOCOL`.
fn protocol() -> Result<Protocol, String> {
    match std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL").as_deref() {
        Err(_) | Ok("") | Ok("http/protobuf") => Ok(Protocol::HttpBinary),
        Ok("http/json") => Ok(Protocol::HttpJson),
        Ok(other) => Err(format!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={other:?} is not supported (http/protobuf or http/json)"
        )),
    }
}

fn tracer_provider() -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol()?)
        .build()
        .map_err(|e| format!("OTLP exporter: {e}"))?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("aviary")
                .build(),
        )
        .build())
}

/// Installs the log subscriber and, when configured, the trace exporter.
/// A trace configuration that cannot work is reported and traces stay off;
/// the process runs on.
pub fn init() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("AVIARY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if std::env::var("AVIARY_LOG_FORMAT").as_deref() == Ok("json") {
        fmt.json().boxed()
    } else {
        fmt.with_ansi(std::io::stderr().is_terminal()).boxed()
    };
    let mut problem = None;
    let otel = if otlp_configured() {
        match tracer_provider() {
            Ok(provider) => {
                let tracer = provider.tracer("aviary");
                let _ = PROVIDER.set(provider);
                Some(tracing_opentelemetry::layer().with_tracer(tracer))
            }
            Err(e) => {
                problem = Some(e);
                None
            }
        }
    } else {
        None
    };
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init();
    if let Some(e) = problem {
        tracing::warn!("traces are off: {e}");
    }
}

/// Exports the spans still buffered (at a clean exit).
pub fn shutdown() {
    if let Some(p) = PROVIDER.get() {
        if let Err(e) = p.shutdown() {
            tracing::warn!("flushing traces: {e}");
        }
    }
}

//! Crash points: named places in a booking where the crash campaign and the demo make the
//! rides service die. Off unless configured.

use std::io::Write;
use std::time::Duration;

/// The points, in the order a booking reaches them.
pub const POINTS: [&str; 6] = [
    // The ride row is written, not committed.
    "create-ride:written",
    // The ride committed with its recovery point; the charge not yet asked for.
    "charge:before-call",
    // The payment service charged; the charge's recovery point is not committed.
    "charge:called",
    // The charge's recovery point committed; the receipt not yet written.
    "receipt:before-write",
    // The receipt is written, not committed (nor is the completion).
    "receipt:written",
    // Everything committed; the answer is not sent.
    "answered",
];

/// What the service does at a crash point.
#[derive(Debug, Clone, Default)]
pub struct CrashPoints {
    /// Print `point NAME KEY` to stdout at each point, then wait this long (so that a test
    /// that kills the process when it reads the line kills it there).
    pub pause: Option<Duration>,
    /// Abort the process at this point.
    pub crash_at: Option<String>,
    /// Print `point NAME KEY` at this point and stop there for good (the crash campaign kills
    /// the process when it reads the line, so the kill lands exactly there).
    pub hold_at: Option<String>,
}

impl CrashPoints {
    /// From `RIDES_PAUSE_MS`, `RIDES_CRASH_AT` and `RIDES_HOLD_AT`.
    pub fn from_env() -> Result<Self, String> {
        let pause = match std::env::var("RIDES_PAUSE_MS") {
            Ok(ms) => Some(Duration::from_millis(ms.parse().map_err(|e| {
                format!("RIDES_PAUSE_MS={ms} is not milliseconds: {e}")
            })?)),
            Err(_) => None,
        };
        let point = |var: &str| -> Result<Option<String>, String> {
            match std::env::var(var) {
                Ok(at) if POINTS.contains(&at.as_str()) => Ok(Some(at)),
                Ok(at) => Err(format!("{var}={at} is none of {POINTS:?}")),
                Err(_) => Ok(None),
            }
        };
        Ok(Self {
            pause,
            crash_at: point("RIDES_CRASH_AT")?,
            hold_at: point("RIDES_HOLD_AT")?,
        })
    }

    /// The booking of `key` reached `point`.
    pub async fn reached(&self, point: &str, key: &str) {
        if self.crash_at.as_deref() == Some(point) {
            eprintln!("rides: crashing at {point} (booking {key})");
            std::process::abort();
        }
        let hold = self.hold_at.as_deref() == Some(point);
        if self.pause.is_some() || hold {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "point {point} {key}");
            let _ = out.flush();
        }
        if hold {
            std::future::pending::<()>().await;
        }
        if let Some(pause) = self.pause {
            tokio::time::sleep(pause).await;
        }
    }
}

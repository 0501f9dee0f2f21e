//! The real `books-api` binary as a child process, for the tests that kill it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A running `books-api` process. Dropping it kills the process, so a failing test leaves
/// none behind.
pub(crate) struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`, as the server printed it.
    pub url: String,
}

impl Server {
    /// Starts the binary with `env` (`BOOKS_PORT` defaults to an ephemeral port, logs to
    /// errors only) and waits until it listens.
    pub(crate) fn start(env: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_books-api"));
        cmd.env("BOOKS_PORT", "0")
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start the books-api binary");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("the server's stdout"))
            .read_line(&mut line)
            .expect("read the server's first line");
        let url = line
            .trim()
            .strip_prefix("books API listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from the server: {line:?}"))
            .to_owned();
        Self { child, url }
    }

    /// SIGKILL, and wait for the process to be gone.
    pub(crate) fn kill(mut self) {
        self.child.kill().expect("SIGKILL the server");
        self.child.wait().expect("reap the server");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

//! An error and its causes as one message: the one place the chain is walked.
//!
//! Contract: every error of the crate shows only its own layer in its `Display` (the step and the
//! object it knows) and hands what caused it on as its [`source`](Error::source), never both. So
//! the chain is written out by joining each layer's text with `": "`, every cause exactly once,
//! with no guessing at what an outer message already says: a short cause (`EIO`) is shown even
//! when an outer layer's text happens to contain it. Whatever shows an error to a person (the
//! command line, a gRPC status, a log line, a report) goes through [`full_message`] or [`Chain`].

use std::error::Error;
use std::fmt;

/// `e`'s text followed by each of its causes, joined with `": "`.
pub fn full_message(e: &(dyn Error + 'static)) -> String {
    Chain(e).to_string()
}

/// `message` followed by `first` and each of its causes, joined with `": "` (for a message that
/// is not itself an error, such as a gRPC status's).
pub fn with_sources(message: String, first: Option<&(dyn Error + 'static)>) -> String {
    match first {
        Some(first) => format!("{message}: {}", Chain(first)),
        None => message,
    }
}

/// [`full_message`] as a method of every error: `err.full_message()`.
pub trait FullMessage {
    /// The error's text followed by each of its causes, joined with `": "`.
    fn full_message(&self) -> String;
}

impl<E: Error + 'static> FullMessage for E {
    fn full_message(&self) -> String {
        full_message(self)
    }
}

/// Shows an error with its causes, as [`full_message`] writes them, without building a string
/// first: `tracing::warn!(error = %Chain(&e), "...")`.
#[derive(Clone, Copy)]
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

impl fmt::Debug for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum E {
        #[error("publish")]
        Publish(#[source] std::io::Error),
        #[error("read EIO-marked state {path}")]
        Read {
            path: &'static str,
            #[source]
            source: Box<E>,
        },
    }

    #[test]
    fn every_layer_is_written_once_in_order() {
        let io = || std::io::Error::other("disk gone");
        assert_eq!(full_message(&E::Publish(io())), "publish: disk gone");
        assert_eq!(
            with_sources("rpc failed".into(), Some(&E::Publish(io()))),
            "rpc failed: publish: disk gone"
        );
        assert_eq!(with_sources("rpc failed".into(), None), "rpc failed");
        let nested = E::Read {
            path: "/w/v",
            source: Box::new(E::Publish(io())),
        };
        assert_eq!(
            Chain(&nested).to_string(),
            "read EIO-marked state /w/v: publish: disk gone"
        );
    }

    /// A cause whose text an outer layer happens to contain is still shown: the walk never drops
    /// a cause by comparing text (a dedupe by substring would have lost `EIO` here).
    #[test]
    fn a_short_cause_found_in_an_outer_message_is_still_shown() {
        let e = E::Read {
            path: "/w/EIO",
            source: Box::new(E::Publish(std::io::Error::other("EIO"))),
        };
        assert_eq!(
            full_message(&e),
            "read EIO-marked state /w/EIO: publish: EIO"
        );
        let shallow = E::Publish(std::io::Error::other("publish"));
        assert_eq!(full_message(&shallow), "publish: publish");
    }
}

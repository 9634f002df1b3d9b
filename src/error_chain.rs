//! An error and its causes as one message. Most of the crate's errors already print their source
//! in their own text, so a cause whose text is already in the message is not repeated.

use std::error::Error;

/// `e`'s text followed by each source whose text it does not already contain.
pub fn full_message(e: &(dyn Error + 'static)) -> String {
    with_sources(e.to_string(), e.source())
}

/// `message` followed by `first` and each of its sources, skipping any whose text `message` already
/// contains.
pub fn with_sources(mut message: String, first: Option<&(dyn Error + 'static)>) -> String {
    let mut next = first;
    while let Some(source) = next {
        let text = source.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        next = source.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum E {
        #[error("read state: {0}")]
        Quotes(#[source] std::io::Error),
        #[error("publish")]
        Hides(#[source] std::io::Error),
    }

    #[test]
    fn causes_are_added_once() {
        let io = || std::io::Error::other("disk gone");
        assert_eq!(full_message(&E::Quotes(io())), "read state: disk gone");
        assert_eq!(full_message(&E::Hides(io())), "publish: disk gone");
        assert_eq!(
            with_sources("rpc failed".into(), Some(&E::Hides(io()))),
            "rpc failed: publish: disk gone"
        );
    }
}

//! The access-mode rule: whether a volume may gain a use, given its CSI access mode and the
//! uses it has. The one copy of the rule, pure, applied by the provider where a use is added
//! ([`StorageProvider::publish_use_as`](crate::provider::StorageProvider::publish_use_as)),
//! before anything is recorded or sent. The CO enforces it: a plugin sees one NodePublish per
//! volume on the node, whatever the number of containers bound to it.
//!
//! | access mode | a writing use | a reading use |
//! |---|---|---|
//! | `SINGLE_NODE_READER_ONLY`, `MULTI_NODE_READER_ONLY` | refused (Mesos' rule; the volume is published read-only) | shared |
//! | `SINGLE_NODE_SINGLE_WRITER` | refused beside any other use | refused beside any other use |
//! | `MULTI_NODE_SINGLE_WRITER` | refused beside another writing use | shared |
//! | `SINGLE_NODE_WRITER` | shared by this node's containers | shared |
//! | `SINGLE_NODE_MULTI_WRITER`, `MULTI_NODE_MULTI_WRITER` | shared | shared |
//!
//! `SINGLE_NODE_WRITER` is the node's, as Kubernetes reads it (`ReadWriteOnce`: every pod on
//! the node may write); one writing container is `SINGLE_NODE_SINGLE_WRITER`
//! (`ReadWriteOncePod`). A use recorded before uses were told apart counts as writing.

use crate::csi::proto::volume_capability::access_mode::Mode;
use crate::provider::state::is_reader_only_mode;

/// How a use reaches the volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// It only reads (the container binds the volume read-only).
    Read,
    /// It writes.
    Write,
}

impl Access {
    /// Whether the use writes.
    pub fn writes(self) -> bool {
        self == Access::Write
    }

    /// The access of a use that binds the volume read-only or not.
    pub fn from_readonly(readonly: bool) -> Access {
        if readonly {
            Access::Read
        } else {
            Access::Write
        }
    }
}

/// Why a use is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A writing use of a reader-only mode.
    ReaderOnly,
    /// A writing use beside `holder`'s, in a single-writer mode.
    SecondWriter {
        /// The container writing to it already.
        holder: String,
    },
    /// A second use of a single-workload mode.
    SecondUse {
        /// The container using it already.
        holder: String,
    },
}

impl Refusal {
    /// What to tell people, after "volume V (access mode M) cannot be used by container C: ".
    pub fn explain(&self) -> String {
        use crate::shown::shown;
        match self {
            Refusal::ReaderOnly => "the mode only allows reading: mount it read-only".to_string(),
            Refusal::SecondWriter { holder } => format!(
                "container '{}' writes to it already and the mode allows one writer: mount it read-only, wait for that container to end, or create the volume with SINGLE_NODE_MULTI_WRITER",
                shown(holder)
            ),
            Refusal::SecondUse { holder } => format!(
                "container '{}' uses it already and the mode allows one container: wait for that container to end, or create the volume with another access mode",
                shown(holder)
            ),
        }
    }
}

/// Whether `container` may use a volume of access mode `mode` (`None`: a name the spec does not
/// define, which no rule limits) with `access`, beside the uses `others` (container, whether it
/// writes; `container`'s own earlier use, if any, is skipped). Holders are looked at in the
/// order given, so the one named is the first.
pub fn admit<'a>(
    mode: Option<Mode>,
    others: impl IntoIterator<Item = (&'a str, bool)>,
    container: &str,
    access: Access,
) -> Result<(), Refusal> {
    let mut others = others.into_iter().filter(|(c, _)| *c != container);
    match mode {
        Some(m) if is_reader_only_mode(m) && access.writes() => Err(Refusal::ReaderOnly),
        Some(Mode::SingleNodeSingleWriter) => match others.next() {
            Some((holder, _)) => Err(Refusal::SecondUse {
                holder: holder.to_string(),
            }),
            None => Ok(()),
        },
        Some(Mode::MultiNodeSingleWriter) if access.writes() => {
            match others.find(|(_, writes)| *writes) {
                Some((holder, _)) => Err(Refusal::SecondWriter {
                    holder: holder.to_string(),
                }),
                None => Ok(()),
            }
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Access::*;

    /// (mode, the use's access, the other uses, the answer)
    type Case<'a> = (Mode, Access, &'a [(&'a str, bool)], Result<(), Refusal>);

    fn refusal(kind: &str, holder: &str) -> Result<(), Refusal> {
        let holder = holder.to_string();
        Err(match kind {
            "reader-only" => Refusal::ReaderOnly,
            "second-writer" => Refusal::SecondWriter { holder },
            "second-use" => Refusal::SecondUse { holder },
            _ => unreachable!(),
        })
    }

    /// Every mode of CSI v1.12 against: no other use, another reader, another writer, the same
    /// container again; for a reading and a writing use.
    #[test]
    fn every_access_mode_admits_and_refuses_as_its_table_says() {
        let none: &[(&str, bool)] = &[];
        let reader: &[(&str, bool)] = &[("r", false)];
        let writer: &[(&str, bool)] = &[("r", false), ("w", true)];
        let itself: &[(&str, bool)] = &[("c", true)];
        let ok = Ok(());
        #[rustfmt::skip]
        let table: Vec<Case> = vec![
            (Mode::SingleNodeReaderOnly, Read, writer, ok.clone()),
            (Mode::SingleNodeReaderOnly, Write, none, refusal("reader-only", "")),
            (Mode::MultiNodeReaderOnly, Read, reader, ok.clone()),
            (Mode::MultiNodeReaderOnly, Write, none, refusal("reader-only", "")),
            (Mode::SingleNodeSingleWriter, Write, none, ok.clone()),
            (Mode::SingleNodeSingleWriter, Read, none, ok.clone()),
            (Mode::SingleNodeSingleWriter, Read, reader, refusal("second-use", "r")),
            (Mode::SingleNodeSingleWriter, Write, reader, refusal("second-use", "r")),
            (Mode::SingleNodeSingleWriter, Write, itself, ok.clone()),
            (Mode::MultiNodeSingleWriter, Write, none, ok.clone()),
            (Mode::MultiNodeSingleWriter, Write, reader, ok.clone()),
            (Mode::MultiNodeSingleWriter, Write, writer, refusal("second-writer", "w")),
            (Mode::MultiNodeSingleWriter, Read, writer, ok.clone()),
            (Mode::MultiNodeSingleWriter, Write, itself, ok.clone()),
            (Mode::SingleNodeWriter, Write, writer, ok.clone()),
            (Mode::SingleNodeWriter, Read, writer, ok.clone()),
            (Mode::SingleNodeMultiWriter, Write, writer, ok.clone()),
            (Mode::SingleNodeMultiWriter, Read, writer, ok.clone()),
            (Mode::MultiNodeMultiWriter, Write, writer, ok.clone()),
            (Mode::MultiNodeMultiWriter, Read, writer, ok.clone()),
        ];
        for (mode, access, others, want) in table {
            let got = admit(Some(mode), others.iter().copied(), "c", access);
            assert_eq!(got, want, "{mode:?} {access:?} beside {others:?}");
        }
        // Every defined mode is in the table above.
        let listed = crate::provider::state::Capability::access_mode_names();
        assert_eq!(listed.len(), 7, "{listed:?}");
        // A mode the spec does not define is not limited (it cannot be recorded: names are
        // checked when set).
        assert_eq!(admit(None, writer.iter().copied(), "c", Write), Ok(()));
    }

    #[test]
    fn refusals_say_what_to_do_and_show_the_holder_escaped() {
        let text = Refusal::SecondWriter {
            holder: "a\u{1b}b".into(),
        }
        .explain();
        assert!(text.contains("'a\\u{1b}b'"), "{text}");
        assert!(text.contains("mount it read-only"), "{text}");
        let text = Refusal::SecondUse { holder: "h".into() }.explain();
        assert!(text.contains("'h' uses it already"), "{text}");
        assert!(Refusal::ReaderOnly.explain().contains("read-only"));
    }
}

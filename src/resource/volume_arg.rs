//! The `--volume NAME:SIZE:CONTAINER_PATH[:ro]` syntax (`run --volume`, the OCI hook's volume
//! annotation) and the byte sizes it and `volume create --size` take.
//!
//! Contract: [`VolumeArg`] parses one entry, or says which part is wrong, quoting the flag and the
//! expected form; [`parse_size`] reads `4096`, `64M`, `10G`, `1KiB` (binary units) and refuses
//! overflow. This is resource syntax, so every front end (the `run` runner, the hook, the CLI, the
//! bundled plugin) takes it from here. Nothing here touches the file system.

use std::str::FromStr;

/// One `--volume NAME:SIZE:CONTAINER_PATH[:ro]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeArg {
    /// The volume name (the same name is the same volume).
    pub name: String,
    /// Its capacity in bytes.
    pub size_bytes: u64,
    /// Where the workload sees it (relative: in its sandbox).
    pub container_path: String,
    /// Mounted read-only.
    pub readonly: bool,
}

impl FromStr for VolumeArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        const FORM: &str = "expected NAME:SIZE:CONTAINER_PATH[:ro], e.g. data:64M:data";
        let parts: Vec<&str> = s.split(':').collect();
        let part = |i: usize, what: &str| -> Result<&str, String> {
            match parts.get(i) {
                Some(p) if !p.is_empty() => Ok(*p),
                _ => Err(format!("--volume '{s}': missing {what} ({FORM})")),
            }
        };
        let name = part(0, "NAME")?;
        let size = part(1, "SIZE")?;
        let container_path = part(2, "CONTAINER_PATH")?;
        let readonly = match parts.get(3) {
            None | Some(&"rw") => false,
            Some(&"ro") => true,
            Some(other) => {
                return Err(format!(
                    "--volume '{s}': unknown mode '{other}' (expected ro or rw)"
                ))
            }
        };
        if parts.len() > 4 {
            return Err(format!(
                "--volume '{s}': too many ':'-separated parts ({FORM})"
            ));
        }
        let size_bytes = parse_size(size)
            .filter(|b| *b > 0)
            .ok_or_else(|| format!("--volume '{s}': invalid SIZE '{size}' (examples: 64M, 1G)"))?;
        Ok(VolumeArg {
            name: name.to_string(),
            size_bytes,
            container_path: container_path.to_string(),
            readonly,
        })
    }
}

/// Parses a byte size with an optional binary suffix (`K`, `M`, `G`, `T`, optionally
/// followed by `i` and/or `B`): `10G` is 10 GiB.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let t = t.strip_suffix('B').unwrap_or(t);
    let t = t.strip_suffix('i').unwrap_or(t);
    let (digits, shift) = match t.chars().last()? {
        'K' | 'k' => (&t[..t.len() - 1], 10),
        'M' | 'm' => (&t[..t.len() - 1], 20),
        'G' | 'g' => (&t[..t.len() - 1], 30),
        'T' | 't' => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("10G"), Some(10 << 30));
        assert_eq!(parse_size("64Mi"), Some(64 << 20));
        assert_eq!(parse_size("1KiB"), Some(1024));
        assert_eq!(parse_size("2T"), Some(2 << 40));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999T"), None);
    }

    #[test]
    fn volume_args() {
        let v: VolumeArg = "data:64M:data".parse().unwrap();
        assert_eq!(
            v,
            VolumeArg {
                name: "data".into(),
                size_bytes: 64 << 20,
                container_path: "data".into(),
                readonly: false
            }
        );
        let v: VolumeArg = "logs:1G:/var/log/app:ro".parse().unwrap();
        assert!(v.readonly);
        assert_eq!(v.container_path, "/var/log/app");
        for (bad, says) in [
            ("data", "missing SIZE"),
            ("data:64M", "missing CONTAINER_PATH"),
            (":64M:x", "missing NAME"),
            ("data:lots:x", "invalid SIZE 'lots'"),
            ("data:0:x", "invalid SIZE '0'"),
            ("data:64M:x:rx", "unknown mode 'rx'"),
            ("data:64M:x:ro:more", "too many"),
        ] {
            let err = bad.parse::<VolumeArg>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}

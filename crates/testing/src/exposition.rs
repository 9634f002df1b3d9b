//! A strict reader of the Prometheus text exposition format 0.0.4, for tests that check what
//! `/metrics` answers: every line is `# HELP`, `# TYPE` or a sample; a family is declared once
//! (HELP, then TYPE) and its samples follow it; a counter's TYPE names it with its `_total`;
//! histogram samples are `_bucket` (with `le`, cumulative, ending at `+Inf` equal to `_count`),
//! `_sum` and `_count`; no sample repeats; label values unescape. OpenMetrics-only lines (`# EOF`,
//! `# UNIT`) are refused: they would mean the body is not the format its content type names.

use std::collections::{BTreeMap, BTreeSet};

/// One family: its name as TYPE gives it, kind, help and samples.
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    /// The name on the `# TYPE` line.
    pub name: String,
    /// `counter`, `gauge`, `histogram`, `summary` or `untyped`.
    pub kind: String,
    /// The `# HELP` text.
    pub help: String,
    /// The samples, in order.
    pub samples: Vec<Sample>,
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric name (with `_bucket`, `_sum`, `_count` for a histogram).
    pub name: String,
    /// The labels, in order, values unescaped.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// The value of label `name`.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The families of `text`, or what is wrong with it (with the line number).
pub fn parse(text: &str) -> Result<Vec<Family>, String> {
    let mut families: Vec<Family> = Vec::new();
    let mut declared = BTreeSet::new();
    let mut help: Option<(String, String)> = None;
    let mut seen = BTreeSet::new();
    for (n, line) in text.lines().enumerate() {
        let at = |what: String| format!("line {}: {what}: {line:?}", n + 1);
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            check_name(name).map_err(at)?;
            help = Some((name.to_string(), text.to_string()));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest
                .split_once(' ')
                .ok_or_else(|| at("TYPE without a kind".into()))?;
            check_name(name).map_err(at)?;
            if !matches!(
                kind,
                "counter" | "gauge" | "histogram" | "summary" | "untyped"
            ) {
                return Err(at(format!("unknown kind {kind}")));
            }
            if kind == "counter" && !name.ends_with("_total") {
                return Err(at("a counter's TYPE must name it with _total".into()));
            }
            if !declared.insert(name.to_string()) {
                return Err(at(format!("family {name} declared twice")));
            }
            let help = match help.take() {
                Some((h, text)) if h == name => text,
                _ => return Err(at(format!("no HELP line right before TYPE {name}"))),
            };
            families.push(Family {
                name: name.to_string(),
                kind: kind.to_string(),
                help,
                samples: Vec::new(),
            });
        } else if line.starts_with('#') {
            return Err(at("a comment that is neither HELP nor TYPE".into()));
        } else if line.is_empty() {
            return Err(at("an empty line".into()));
        } else {
            let sample = parse_sample(line).map_err(at)?;
            let family = families
                .last_mut()
                .ok_or_else(|| at("a sample before any TYPE".into()))?;
            let suffixes: &[&str] = match family.kind.as_str() {
                "histogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["", "_sum", "_count"],
                _ => &[""],
            };
            if !suffixes
                .iter()
                .any(|s| sample.name == format!("{}{s}", family.name))
            {
                return Err(at(format!("not a sample of family {}", family.name)));
            }
            if !seen.insert(format!("{}{:?}", sample.name, sample.labels)) {
                return Err(at("a sample repeated".into()));
            }
            family.samples.push(sample);
        }
    }
    for f in families.iter().filter(|f| f.kind == "histogram") {
        check_histogram(f)?;
    }
    Ok(families)
}

/// The family named `name` (as its TYPE line names it).
pub fn family<'f>(families: &'f [Family], name: &str) -> Option<&'f Family> {
    families.iter().find(|f| f.name == name)
}

fn check_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':');
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
        Ok(())
    } else {
        Err(format!("bad metric name {name:?}"))
    }
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let end = line
        .find(['{', ' '])
        .ok_or_else(|| "a sample without a value".to_string())?;
    let name = &line[..end];
    check_name(name)?;
    let mut rest = &line[end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices().peekable();
        loop {
            let start = chars.peek().map(|(i, _)| *i).ok_or("unterminated labels")?;
            if inner[start..].starts_with('}') {
                rest = &inner[start + 1..];
                break;
            }
            let eq = inner[start..].find('=').ok_or("a label without =")? + start;
            let key = &inner[start..eq];
            if key.is_empty()
                || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                || key.starts_with(|c: char| c.is_ascii_digit())
            {
                return Err(format!("bad label name {key:?}"));
            }
            if !inner[eq + 1..].starts_with('"') {
                return Err("a label value not quoted".into());
            }
            while chars.peek().is_some_and(|(i, _)| *i <= eq + 1) {
                chars.next();
            }
            let mut value = String::new();
            loop {
                match chars.next().ok_or("unterminated label value")?.1 {
                    '"' => break,
                    '\\' => match chars.next().ok_or("a lone backslash")?.1 {
                        '\\' => value.push('\\'),
                        '"' => value.push('"'),
                        'n' => value.push('\n'),
                        c => return Err(format!("bad escape \\{c}")),
                    },
                    '\n' => return Err("a raw newline in a label value".into()),
                    c => value.push(c),
                }
            }
            labels.push((key.to_string(), value));
            match chars.peek() {
                Some((_, ',')) => {
                    chars.next();
                }
                Some((_, '}')) => {}
                _ => return Err("labels not separated by ,".into()),
            }
        }
    }
    let value = rest.strip_prefix(' ').ok_or("no space before the value")?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse::<f64>().map_err(|_| format!("bad value {v:?}"))?,
    };
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

fn check_histogram(f: &Family) -> Result<(), String> {
    type Series = Vec<(String, String)>;
    let mut buckets: BTreeMap<Series, Vec<(f64, f64)>> = BTreeMap::new();
    let mut counts: BTreeMap<Series, f64> = BTreeMap::new();
    for s in &f.samples {
        let others: Series = s
            .labels
            .iter()
            .filter(|(k, _)| k != "le")
            .cloned()
            .collect();
        if s.name.ends_with("_bucket") {
            let le = s
                .label("le")
                .ok_or_else(|| format!("{}: a bucket without le", f.name))?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse()
                    .map_err(|_| format!("{}: bad le {le:?}", f.name))?
            };
            buckets.entry(others).or_default().push((le, s.value));
        } else if s.name.ends_with("_count") {
            counts.insert(others, s.value);
        }
    }
    for (series, b) in &buckets {
        if !b.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1) {
            return Err(format!(
                "{} {series:?}: buckets not ascending and cumulative",
                f.name
            ));
        }
        let last = b.last().copied().unwrap_or((0.0, 0.0));
        if last.0 != f64::INFINITY || counts.get(series) != Some(&last.1) {
            return Err(format!(
                "{} {series:?}: the +Inf bucket is not the last or not the count",
                f.name
            ));
        }
    }
    if buckets.len() != counts.len() {
        return Err(format!("{}: a series without buckets or count", f.name));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"q\\\"\\\\\\n\"} 1\n# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"0.5\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 3.5\nh_count 2\n";

    #[test]
    fn reads_a_good_exposition() {
        let f = parse(GOOD).unwrap();
        assert_eq!(f.len(), 2);
        assert_eq!(f[0].samples[0].label("x"), Some("q\"\\\n"));
        assert_eq!(family(&f, "h").unwrap().samples.len(), 4);
    }

    #[test]
    fn refuses_what_a_0_0_4_parser_would_misread() {
        for (bad, why) in [
            (
                GOOD.replace("a_total counter", "a counter")
                    .replace("# HELP a_total", "# HELP a"),
                "_total",
            ),
            (format!("{GOOD}# EOF\n"), "neither HELP nor TYPE"),
            (
                GOOD.replace("h_bucket{le=\"+Inf\"} 2", "h_bucket{le=\"+Inf\"} 0"),
                "cumulative",
            ),
            (GOOD.replace("h_count 2", "h_count 3"), "not the count"),
            (
                format!("{GOOD}# HELP h H.\n# TYPE h histogram\n"),
                "declared twice",
            ),
            (GOOD.replace("a_total{x", "b_total{x"), "not a sample of"),
            (GOOD.replace("a_total{x=\"q", "a_total{x=q"), "not quoted"),
            (format!("{GOOD}h_sum 3.5\n"), "repeated"),
        ] {
            let e = parse(&bad).unwrap_err();
            assert!(e.contains(why), "{why}: {e}");
        }
    }
}

//! Small sorted collections for records held in memory by the thousand: a string map and a
//! string set kept as one sorted vector each.
//!
//! A provider keeps every volume's record in memory, and a record's maps (parameters, the
//! contexts a plugin answered) and sets (the containers using it) usually hold zero to a few
//! entries. `BTreeMap`/`BTreeSet` allocate a whole node for the first entry (11 slots: 544
//! bytes for a `String` map, 288 for a `String` set): at 10,000 volumes that was over 1 KiB per
//! volume (docs/benchmarks.md, "Memory, seventh session"). A sorted vector holds what is there.
//!
//! Contract: [`SortedMap`] and [`SortedSet`] iterate in key order, serialize exactly as a
//! `BTreeMap` (a JSON object, keys sorted) and a `BTreeSet` (a sorted JSON array) do, and
//! deserialize from the same (a repeated key: the last value wins, as `BTreeMap` does; a
//! repeated item is kept once). Lookups are binary searches; an insert or removal moves the
//! entries after it, which for the few entries a record has is cheaper than a tree's node. A
//! hostile file of many entries is read in O(n log n) (collected, then sorted), never O(n²).

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A map of strings in key order, as one sorted vector (see the module doc).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct SortedMap {
    entries: Vec<(String, String)>,
}

impl SortedMap {
    /// An empty map (allocates nothing).
    pub const fn new() -> Self {
        SortedMap {
            entries: Vec::new(),
        }
    }

    fn find<Q: Ord + ?Sized>(&self, key: &Q) -> Result<usize, usize>
    where
        String: Borrow<Q>,
    {
        self.entries.binary_search_by(|(k, _)| k.borrow().cmp(key))
    }

    /// The value of `key`.
    pub fn get<Q: Ord + ?Sized>(&self, key: &Q) -> Option<&String>
    where
        String: Borrow<Q>,
    {
        self.find(key).ok().map(|i| &self.entries[i].1)
    }

    /// Whether `key` has a value.
    pub fn contains_key<Q: Ord + ?Sized>(&self, key: &Q) -> bool
    where
        String: Borrow<Q>,
    {
        self.find(key).is_ok()
    }

    /// Sets `key` to `value`; returns the value it had.
    pub fn insert(&mut self, key: String, value: String) -> Option<String> {
        match self.find(key.as_str()) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            Err(i) => {
                self.entries.insert(i, (key, value));
                None
            }
        }
    }

    /// Removes `key`; returns its value.
    pub fn remove<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<String>
    where
        String: Borrow<Q>,
    {
        self.find(key).ok().map(|i| self.entries.remove(i).1)
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is no key.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&String, &String)> + ExactSizeIterator {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    /// The keys in order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &String> + ExactSizeIterator {
        self.entries.iter().map(|(k, _)| k)
    }

    /// The values in key order.
    pub fn values(&self) -> impl DoubleEndedIterator<Item = &String> + ExactSizeIterator {
        self.entries.iter().map(|(_, v)| v)
    }

    /// Keeps the entries `keep` accepts.
    pub fn retain(&mut self, mut keep: impl FnMut(&String, &mut String) -> bool) {
        self.entries.retain_mut(|(k, v)| keep(k, v));
    }

    /// Removes every entry (keeps no room).
    pub fn clear(&mut self) {
        self.entries = Vec::new();
    }

    /// The same entries as a `BTreeMap`.
    pub fn to_btree(&self) -> BTreeMap<String, String> {
        self.entries.iter().cloned().collect()
    }

    /// From entries in any order, repeated keys included (the last one wins, as in a
    /// `BTreeMap`): one stable sort, O(n log n).
    fn from_entries(mut entries: Vec<(String, String)>) -> Self {
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        // After a stable sort the last of equal keys is the last given: keep that one.
        let mut kept: Vec<(String, String)> = Vec::with_capacity(entries.len());
        for e in entries {
            match kept.last_mut() {
                Some(last) if last.0 == e.0 => *last = e,
                _ => kept.push(e),
            }
        }
        kept.shrink_to_fit();
        SortedMap { entries: kept }
    }
}

impl fmt::Debug for SortedMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<Q: Ord + ?Sized> std::ops::Index<&Q> for SortedMap
where
    String: Borrow<Q>,
{
    type Output = String;

    /// The value of `key`; panics when there is none, as a `BTreeMap`'s index does.
    fn index(&self, key: &Q) -> &String {
        self.get(key).expect("no entry found for key")
    }
}

impl FromIterator<(String, String)> for SortedMap {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        SortedMap::from_entries(iter.into_iter().collect())
    }
}

impl Extend<(String, String)> for SortedMap {
    fn extend<I: IntoIterator<Item = (String, String)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

impl IntoIterator for SortedMap {
    type Item = (String, String);
    type IntoIter = std::vec::IntoIter<(String, String)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.into_iter()
    }
}

impl<'a> IntoIterator for &'a SortedMap {
    type Item = (&'a String, &'a String);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, String)>,
        fn(&'a (String, String)) -> (&'a String, &'a String),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(k, v)| (k, v))
    }
}

impl From<BTreeMap<String, String>> for SortedMap {
    fn from(map: BTreeMap<String, String>) -> Self {
        // Already sorted and unique.
        SortedMap {
            entries: map.into_iter().collect(),
        }
    }
}

impl<const N: usize> From<[(String, String); N]> for SortedMap {
    fn from(entries: [(String, String); N]) -> Self {
        SortedMap::from_entries(entries.into())
    }
}

impl PartialEq<BTreeMap<String, String>> for SortedMap {
    fn eq(&self, other: &BTreeMap<String, String>) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == b)
    }
}

impl Serialize for SortedMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for SortedMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor;
        impl<'de> Visitor<'de> for MapVisitor {
            type Value = SortedMap;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<SortedMap, A::Error> {
                // The size hint is the input's claim: capped, never trusted for an allocation.
                let mut entries = Vec::with_capacity(access.size_hint().unwrap_or(0).min(64));
                while let Some(entry) = access.next_entry::<String, String>()? {
                    entries.push(entry);
                }
                Ok(SortedMap::from_entries(entries))
            }
        }
        deserializer.deserialize_map(MapVisitor)
    }
}

/// A set of strings in order, as one sorted vector (see the module doc).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct SortedSet {
    items: Vec<String>,
}

impl SortedSet {
    /// An empty set (allocates nothing).
    pub const fn new() -> Self {
        SortedSet { items: Vec::new() }
    }

    fn find<Q: Ord + ?Sized>(&self, item: &Q) -> Result<usize, usize>
    where
        String: Borrow<Q>,
    {
        self.items.binary_search_by(|i| i.borrow().cmp(item))
    }

    /// Whether `item` is in the set.
    pub fn contains<Q: Ord + ?Sized>(&self, item: &Q) -> bool
    where
        String: Borrow<Q>,
    {
        self.find(item).is_ok()
    }

    /// Adds `item`; returns whether it was new.
    pub fn insert(&mut self, item: String) -> bool {
        match self.find(item.as_str()) {
            Ok(_) => false,
            Err(i) => {
                self.items.insert(i, item);
                true
            }
        }
    }

    /// Removes `item`; returns whether it was there.
    pub fn remove<Q: Ord + ?Sized>(&mut self, item: &Q) -> bool
    where
        String: Borrow<Q>,
    {
        match self.find(item) {
            Ok(i) => {
                self.items.remove(i);
                if self.items.is_empty() {
                    self.items = Vec::new();
                }
                true
            }
            Err(_) => false,
        }
    }

    /// How many items.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The items in order.
    pub fn iter(&self) -> std::slice::Iter<'_, String> {
        self.items.iter()
    }

    /// The first item in order.
    pub fn first(&self) -> Option<&String> {
        self.items.first()
    }

    /// Keeps the items `keep` accepts.
    pub fn retain(&mut self, keep: impl FnMut(&String) -> bool) {
        self.items.retain(keep);
    }

    /// Removes every item (keeps no room).
    pub fn clear(&mut self) {
        self.items = Vec::new();
    }

    /// The items, sorted, as a slice.
    pub fn as_slice(&self) -> &[String] {
        &self.items
    }

    /// From items in any order, repeated ones included: one sort, O(n log n).
    fn from_items(mut items: Vec<String>) -> Self {
        items.sort_unstable();
        items.dedup();
        items.shrink_to_fit();
        SortedSet { items }
    }
}

impl fmt::Debug for SortedSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl FromIterator<String> for SortedSet {
    fn from_iter<I: IntoIterator<Item = String>>(iter: I) -> Self {
        SortedSet::from_items(iter.into_iter().collect())
    }
}

impl Extend<String> for SortedSet {
    fn extend<I: IntoIterator<Item = String>>(&mut self, iter: I) {
        let mut items = std::mem::take(&mut self.items);
        items.extend(iter);
        *self = SortedSet::from_items(items);
    }
}

impl IntoIterator for SortedSet {
    type Item = String;
    type IntoIter = std::vec::IntoIter<String>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter()
    }
}

impl<'a> IntoIterator for &'a SortedSet {
    type Item = &'a String;
    type IntoIter = std::slice::Iter<'a, String>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

impl From<BTreeSet<String>> for SortedSet {
    fn from(set: BTreeSet<String>) -> Self {
        SortedSet {
            items: set.into_iter().collect(),
        }
    }
}

impl<const N: usize> From<[String; N]> for SortedSet {
    fn from(items: [String; N]) -> Self {
        SortedSet::from_items(items.into())
    }
}

impl PartialEq<BTreeSet<String>> for SortedSet {
    fn eq(&self, other: &BTreeSet<String>) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == b)
    }
}

impl Serialize for SortedSet {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for SortedSet {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SeqVisitor;
        impl<'de> Visitor<'de> for SeqVisitor {
            type Value = SortedSet;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of strings")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut access: A) -> Result<SortedSet, A::Error> {
                let mut items = Vec::with_capacity(access.size_hint().unwrap_or(0).min(64));
                while let Some(item) = access.next_element::<String>()? {
                    items.push(item);
                }
                Ok(SortedSet::from_items(items))
            }
        }
        deserializer.deserialize_seq(SeqVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> String {
        x.to_string()
    }

    #[test]
    fn a_map_serializes_and_reads_back_as_a_btree_map_does() {
        let tree: BTreeMap<String, String> =
            [(s("b"), s("2")), (s("a"), s("1")), (s("c"), s("3"))].into();
        let map: SortedMap = tree.clone().into();
        assert_eq!(
            serde_json::to_string(&map).unwrap(),
            serde_json::to_string(&tree).unwrap()
        );
        let text = r#"{"z":"1","a":"2","m":"3","a":"4"}"#;
        let read: SortedMap = serde_json::from_str(text).unwrap();
        let read_tree: BTreeMap<String, String> = serde_json::from_str(text).unwrap();
        assert_eq!(
            read, read_tree,
            "the last of a repeated key wins, as in a BTreeMap"
        );
        assert_eq!(read.keys().collect::<Vec<_>>(), ["a", "m", "z"]);
        assert!(serde_json::from_str::<SortedMap>(r#"{"a":1}"#).is_err());
        assert!(serde_json::from_str::<SortedMap>("[]").is_err());
    }

    #[test]
    fn a_set_serializes_and_reads_back_as_a_btree_set_does() {
        let tree: BTreeSet<String> = [s("c1"), s("a1"), s("b1")].into();
        let set: SortedSet = tree.clone().into();
        assert_eq!(
            serde_json::to_string(&set).unwrap(),
            serde_json::to_string(&tree).unwrap()
        );
        let read: SortedSet = serde_json::from_str(r#"["z","a","z","m"]"#).unwrap();
        assert_eq!(
            read.as_slice(),
            ["a", "m", "z"],
            "sorted, repeats kept once"
        );
        assert!(serde_json::from_str::<SortedSet>(r#"{"a":"b"}"#).is_err());
    }

    #[test]
    fn a_map_inserts_replaces_and_removes_in_order() {
        let mut map = SortedMap::new();
        assert_eq!(map.insert(s("b"), s("1")), None);
        assert_eq!(map.insert(s("a"), s("2")), None);
        assert_eq!(map.insert(s("b"), s("3")), Some(s("1")));
        assert_eq!(map.get("b"), Some(&s("3")));
        assert!(map.contains_key("a") && !map.contains_key("c"));
        assert_eq!(
            map.iter().collect::<Vec<_>>(),
            [(&s("a"), &s("2")), (&s("b"), &s("3"))]
        );
        assert_eq!(map.remove("a"), Some(s("2")));
        assert_eq!(map.remove("a"), None);
        map.extend([(s("d"), s("4")), (s("c"), s("5"))]);
        assert_eq!(map.keys().collect::<Vec<_>>(), ["b", "c", "d"]);
        map.retain(|k, _| k != "c");
        assert_eq!(map.len(), 2);
        map.clear();
        assert!(map.is_empty());
    }

    #[test]
    fn a_set_inserts_and_removes_in_order() {
        let mut set = SortedSet::new();
        assert!(set.insert(s("b")));
        assert!(set.insert(s("a")));
        assert!(!set.insert(s("b")), "an item already there is not new");
        assert_eq!(set.first(), Some(&s("a")));
        assert!(set.contains("b") && !set.contains("c"));
        assert!(set.remove("a") && !set.remove("a"));
        set.extend([s("d"), s("c"), s("b")]);
        assert_eq!(set.as_slice(), ["b", "c", "d"]);
        set.retain(|i| i != "c");
        assert_eq!(set.len(), 2);
    }

    #[test]
    fn a_large_input_in_reverse_order_is_read_sorted() {
        // Read by one sort (O(n log n)), not an insert per key (O(n²) moves).
        let n = 20_000;
        let text = format!(
            "{{{}}}",
            (0..n)
                .rev()
                .map(|i| format!("\"k{i:07}\":\"v\""))
                .collect::<Vec<_>>()
                .join(",")
        );
        let map: SortedMap = serde_json::from_str(&text).unwrap();
        assert_eq!(map.len(), n);
        assert!(map.keys().zip(map.keys().skip(1)).all(|(a, b)| a < b));
    }

    #[test]
    fn one_entry_costs_its_own_room_not_a_tree_node() {
        let one: SortedMap = [(s("k"), s("v"))].into();
        assert_eq!(one.entries.capacity(), 1);
        let set: SortedSet = [s("c")].into();
        assert_eq!(set.items.capacity(), 1);
    }
}

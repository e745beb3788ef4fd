//! A sharded outbox (`outboxd migrate --shards N`, `outboxd run --shard I/N`): one outbox
//! table, N publications that each carry the aggregates of one shard (a row filter), and one
//! slot and relay per shard. An aggregate lives in one shard, so its order holds.
//!
//! The shard of an aggregate is its key modulo N, the key being the first byte of the md5 of
//! its id (0..=255): a built-in immutable expression, as PostgreSQL requires of a publication's
//! row filter, and the same on every version and platform. N is a power of two, so that
//! doubling the shards splits each one in two: shard `i` of `2N` holds a subset of shard
//! `i mod N` of `N`, and no aggregate's events are spread over two old shards.
//!
//! Every walsender decodes all of its database's WAL, whatever the filter (docs/scaling.md):
//! shards spread the relay's work, not PostgreSQL's decoding.

use std::fmt;

/// Shard `index` of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: u16,
    pub count: u16,
}

/// The most shards: the key has 256 values.
pub const MAX_SHARDS: u16 = 256;

impl Shard {
    /// `I/N`, e.g. `3/8`: N a power of two from 1 to 256, I below N.
    pub fn parse(s: &str) -> Result<Shard, String> {
        let (i, n) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not a shard: write INDEX/COUNT, e.g. 3/8"))?;
        let count = parse_count(n)?;
        let index: u16 = i
            .trim()
            .parse()
            .map_err(|_| format!("{i:?} is not a shard index"))?;
        if index >= count {
            return Err(format!(
                "shard index {index} is not below the shard count {count} (shards are 0 to {})",
                count - 1
            ));
        }
        Ok(Shard { index, count })
    }

    /// The SQL condition (immutable built-ins only: usable as a publication's row filter) that
    /// `aggregate_id` (a column or expression) belongs to this shard.
    pub fn filter_sql(&self, aggregate_id: &str) -> String {
        format!(
            "({} % {} = {})",
            key_sql(aggregate_id),
            self.count,
            self.index
        )
    }

    /// The name of this shard's publication or slot, from the unsharded one.
    pub fn name(&self, base: &str) -> String {
        format!("{base}_shard{}of{}", self.index, self.count)
    }

    /// The shard whose publication or slot is `name`, from the unsharded `base` name (the
    /// inverse of [`Shard::name`]); `None` when `name` is not a shard's.
    pub fn from_name(name: &str, base: &str) -> Option<Shard> {
        let rest = name.strip_prefix(base)?.strip_prefix("_shard")?;
        let (i, n) = rest.split_once("of")?;
        Shard::parse(&format!("{i}/{n}")).ok()
    }

    /// Every shard of `count`.
    pub fn all(count: u16) -> impl Iterator<Item = Shard> {
        (0..count).map(move |index| Shard { index, count })
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// A shard count: a power of two from 1 to [`MAX_SHARDS`].
pub fn parse_count(n: &str) -> Result<u16, String> {
    match n.trim().parse::<u16>() {
        Ok(c) if (1..=MAX_SHARDS).contains(&c) && c.is_power_of_two() => Ok(c),
        _ => Err(format!(
            "{n:?} is not a shard count: a power of two from 1 to {MAX_SHARDS} (so that doubling it splits every shard in two)"
        )),
    }
}

/// The shard key of `aggregate_id` in SQL: 0..=255.
pub fn key_sql(aggregate_id: &str) -> String {
    format!("get_byte(decode(md5({aggregate_id}), 'hex'), 0)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_parse_and_refuse_what_cannot_split() {
        assert_eq!(Shard::parse("3/8").unwrap(), Shard { index: 3, count: 8 });
        assert_eq!(Shard::parse("0/1").unwrap().to_string(), "0/1");
        assert!(Shard::parse("8/8").unwrap_err().contains("not below"));
        assert!(Shard::parse("1/6").unwrap_err().contains("power of two"));
        assert!(Shard::parse("1/512").unwrap_err().contains("power of two"));
        assert!(Shard::parse("3").unwrap_err().contains("INDEX/COUNT"));
    }

    #[test]
    fn names_and_filters_name_the_shard() {
        let s = Shard { index: 5, count: 8 };
        assert_eq!(s.name("outbox_pub"), "outbox_pub_shard5of8");
        assert_eq!(
            s.filter_sql("aggregate_id"),
            "(get_byte(decode(md5(aggregate_id), 'hex'), 0) % 8 = 5)"
        );
        assert_eq!(Shard::all(4).count(), 4);
        assert_eq!(
            Shard::from_name("outbox_pub_shard5of8", "outbox_pub"),
            Some(s)
        );
        assert_eq!(Shard::from_name("outbox_pub_shard8of8", "outbox_pub"), None);
        assert_eq!(Shard::from_name("outbox_pub", "outbox_pub"), None);
        assert_eq!(Shard::from_name("other_shard1of2", "outbox_pub"), None);
    }
}

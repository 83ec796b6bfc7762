//! The host file through which a `local` transport offers its shared-memory regions to other
//! processes on the same host: `/dev/shm/kvx-local-<name>.desc`, a small text file.
//!
//! Format (ASCII, one record per line, fields separated by one space):
//! `kvx-local 1 <pid>` then, per region, `<base> <len> <key> <shm-file-name>` with decimal
//! integers, regions sorted by base and non-overlapping. Written atomically (temp + rename).

use crate::segment::{RegionDesc, RegionKey};
use crate::shm::valid_name;

/// One shared region as listed in the host file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRegion {
    /// The region as the owner registered it (base = address in the owner's process).
    pub desc: RegionDesc,
    /// The `/dev/shm` file backing it.
    pub file: String,
}

/// A parsed host file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFile {
    /// Owner process id.
    pub pid: u32,
    /// Regions, sorted by base.
    pub regions: Vec<HostRegion>,
}

/// A host file that could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostFileError {
    /// The first line is not `kvx-local 1 <pid>`.
    #[error("bad header line")]
    BadHeader,
    /// A region line is malformed.
    #[error("bad region on line {0}")]
    BadRegion(usize),
    /// Regions overlap or are out of order.
    #[error("regions overlap or are unsorted at line {0}")]
    Overlap(usize),
}

impl HostFile {
    /// Encodes the file contents.
    pub fn encode(&self) -> String {
        let mut s = format!("kvx-local 1 {}\n", self.pid);
        for r in &self.regions {
            s.push_str(&format!(
                "{} {} {} {}\n",
                r.desc.base, r.desc.len, r.desc.key.0, r.file
            ));
        }
        s
    }

    /// Parses the file contents.
    pub fn parse(text: &str) -> Result<Self, HostFileError> {
        let mut lines = text.lines();
        let header: Vec<&str> = lines
            .next()
            .ok_or(HostFileError::BadHeader)?
            .split(' ')
            .collect();
        let pid = match header.as_slice() {
            ["kvx-local", "1", pid] => pid.parse().map_err(|_| HostFileError::BadHeader)?,
            _ => return Err(HostFileError::BadHeader),
        };
        let mut regions: Vec<HostRegion> = Vec::new();
        for (i, line) in lines.enumerate() {
            let n = i + 2;
            let f: Vec<&str> = line.split(' ').collect();
            let [base, len, key, file] = f.as_slice() else {
                return Err(HostFileError::BadRegion(n));
            };
            let bad = |_| HostFileError::BadRegion(n);
            let desc = RegionDesc {
                base: base.parse().map_err(bad)?,
                len: len.parse().map_err(bad)?,
                key: RegionKey(key.parse().map_err(bad)?),
            };
            if desc.len == 0 || desc.base.checked_add(desc.len).is_none() || !valid_name(file) {
                return Err(HostFileError::BadRegion(n));
            }
            if let Some(prev) = regions.last()
                && prev.desc.base + prev.desc.len > desc.base
            {
                return Err(HostFileError::Overlap(n));
            }
            regions.push(HostRegion {
                desc,
                file: (*file).to_owned(),
            });
        }
        Ok(HostFile { pid, regions })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_errors() {
        let f = HostFile {
            pid: 42,
            regions: vec![
                HostRegion {
                    desc: RegionDesc {
                        base: 4096,
                        len: 100,
                        key: RegionKey(7),
                    },
                    file: "kvx-a".into(),
                },
                HostRegion {
                    desc: RegionDesc {
                        base: 8192,
                        len: 1,
                        key: RegionKey(8),
                    },
                    file: "kvx-b".into(),
                },
            ],
        };
        assert_eq!(HostFile::parse(&f.encode()).unwrap(), f);
        assert_eq!(HostFile::parse(""), Err(HostFileError::BadHeader));
        assert_eq!(
            HostFile::parse("kvx-local 2 1\n"),
            Err(HostFileError::BadHeader)
        );
        assert_eq!(
            HostFile::parse("kvx-local 1 1\n1 0 1 x\n"),
            Err(HostFileError::BadRegion(2))
        );
        assert_eq!(
            HostFile::parse("kvx-local 1 1\n1 1 1 ../etc\n"),
            Err(HostFileError::BadRegion(2))
        );
        assert_eq!(
            HostFile::parse("kvx-local 1 1\n10 10 1 a\n15 1 2 b\n"),
            Err(HostFileError::Overlap(3))
        );
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in "\\PC{0,200}") {
            let _ = HostFile::parse(&s);
        }

        #[test]
        fn parse_never_panics_near_valid(lines in proptest::collection::vec("[0-9a-z -]{0,30}", 0..5)) {
            let s = format!("kvx-local 1 5\n{}", lines.join("\n"));
            let _ = HostFile::parse(&s);
        }
    }
}

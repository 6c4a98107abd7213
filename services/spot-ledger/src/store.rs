//! The write-ahead log: one file, `spot.wal`, in `TXFLOW_SPOT_WAL_DIR`, that only grows.
//!
//! A record is a frame: `len` (u32, little-endian, the payload's length), `crc` (u32,
//! little-endian, CRC-32 of the payload), then the payload, the [`Record`] as JSON. A record is
//! appended and `fsync`ed (`sync_data`) before the ledger applies it and before any reply.
//!
//! At start the log is read from the beginning ([`decode_all`]). A frame that is incomplete or
//! fails its checksum and reaches the end of the file is the torn tail of a write cut short by a
//! crash: it was never acknowledged, so it is cut off (the file truncated to the last complete
//! record) and the ledger starts from the complete records. A damaged frame with data after it
//! is not a torn write: the ledger refuses to start ([`WalError::Corrupt`]) rather than drop
//! acknowledged operations.
//!
//! One writer: the directory is locked (`LOCK`, an exclusive `flock`) for as long as the process
//! lives; a second process on the same directory gets [`WalError::Locked`].

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::decide::Record;

/// The log's file name in the directory.
pub const WAL_FILE: &str = "spot.wal";
/// The lock file's name in the directory.
pub const LOCK_FILE: &str = "LOCK";
/// The largest payload a frame may declare.
pub const MAX_RECORD: u32 = 64 * 1024;
const HEADER: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error(
        "the write-ahead log {dir} is in use by another spot-ledger process (one process per ledger)"
    )]
    Locked { dir: PathBuf },
    #[error("write-ahead log {path}: {action}")]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("write-ahead log is damaged at byte {offset} with data after it: {reason}")]
    Corrupt { offset: u64, reason: String },
    #[error("encoding record {seq}")]
    Encode {
        seq: u64,
        #[source]
        source: serde_json::Error,
    },
}

/// The records of a log and where its complete part ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    pub records: Vec<Record>,
    /// The length of the complete records.
    pub valid_len: u64,
    /// The bytes of a torn tail after them (0 when the log ends cleanly).
    pub torn: u64,
}

/// One record as a frame.
pub fn encode(record: &Record) -> Result<Vec<u8>, WalError> {
    let payload = serde_json::to_vec(record).map_err(|source| WalError::Encode {
        seq: record.seq,
        source,
    })?;
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l <= MAX_RECORD)
        .ok_or_else(|| WalError::Corrupt {
            offset: 0,
            reason: format!("record {} is {} bytes", record.seq, payload.len()),
        })?;
    let mut frame = Vec::with_capacity(HEADER + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// Reads every complete record of `bytes`; a damaged last frame is a torn tail.
pub fn decode_all(bytes: &[u8]) -> Result<Decoded, WalError> {
    let mut records = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let rest = &bytes[at..];
        match frame(rest) {
            Ok((record, used)) => {
                records.push(record);
                at += used;
            }
            Err(Bad {
                reaches_end,
                reason,
            }) => {
                if reaches_end || rest.iter().all(|b| *b == 0) {
                    return Ok(Decoded {
                        records,
                        valid_len: at as u64,
                        torn: rest.len() as u64,
                    });
                }
                return Err(WalError::Corrupt {
                    offset: at as u64,
                    reason,
                });
            }
        }
    }
    Ok(Decoded {
        records,
        valid_len: at as u64,
        torn: 0,
    })
}

struct Bad {
    /// The damaged frame extends to (or past) the end of the file.
    reaches_end: bool,
    reason: String,
}

fn frame(rest: &[u8]) -> Result<(Record, usize), Bad> {
    let torn = |reason: &str| Bad {
        reaches_end: true,
        reason: reason.to_string(),
    };
    if rest.len() < HEADER {
        return Err(torn("incomplete header"));
    }
    let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
    let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
    let end = HEADER as u64 + u64::from(len);
    let reaches_end = end >= rest.len() as u64;
    if len == 0 || len > MAX_RECORD {
        return Err(Bad {
            reaches_end,
            reason: format!("implausible length {len}"),
        });
    }
    if end > rest.len() as u64 {
        return Err(torn("incomplete payload"));
    }
    let payload = &rest[HEADER..end as usize];
    if crc32fast::hash(payload) != crc {
        return Err(Bad {
            reaches_end,
            reason: "checksum mismatch".into(),
        });
    }
    // A payload whose checksum holds was written whole: failing to read it is not a torn write.
    let record = serde_json::from_slice(payload).map_err(|e| Bad {
        reaches_end: false,
        reason: format!("record does not decode: {e}"),
    })?;
    Ok((record, end as usize))
}

/// The open log: the append handle, and the directory lock held until it is dropped.
#[derive(Debug)]
pub struct Wal {
    path: PathBuf,
    file: File,
    len: u64,
    _lock: File,
}

/// What opening found.
#[derive(Debug)]
pub struct Opened {
    pub wal: Wal,
    pub records: Vec<Record>,
    /// Bytes of a torn tail cut off (0 for a clean log).
    pub torn: u64,
}

fn io(path: &Path, action: &'static str) -> impl FnOnce(std::io::Error) -> WalError + use<> {
    let path = path.to_path_buf();
    move |source| WalError::Io {
        path,
        action,
        source,
    }
}

impl Wal {
    /// Locks `dir` (created if missing), reads its log and cuts off a torn tail.
    pub fn open(dir: &Path) -> Result<Opened, WalError> {
        std::fs::create_dir_all(dir).map_err(io(dir, "creating the directory"))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path, "opening the lock file"))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(WalError::Locked {
                    dir: dir.to_path_buf(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(&lock_path, "locking")(e)),
        }
        let path = dir.join(WAL_FILE);
        let existed = path.exists();
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io(&path, "opening"))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io(&path, "reading"))?;
        let decoded = decode_all(&bytes)?;
        if decoded.torn > 0 {
            file.set_len(decoded.valid_len)
                .map_err(io(&path, "cutting off the torn tail"))?;
            file.sync_all().map_err(io(&path, "syncing the cut"))?;
        }
        if !existed {
            // The new file's directory entry is durable too.
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io(dir, "syncing the directory"))?;
        }
        Ok(Opened {
            wal: Wal {
                path,
                file,
                len: decoded.valid_len,
                _lock: lock,
            },
            records: decoded.records,
            torn: decoded.torn,
        })
    }

    /// Appends `record` and waits until it is on disk. On failure the file is cut back to its
    /// last complete record (as far as the disk allows; a restart checks again).
    pub fn append(&mut self, record: &Record) -> Result<(), WalError> {
        let frame = encode(record)?;
        let written = self
            .file
            .write_all_at_end(&frame)
            .and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len += frame.len() as u64;
                Ok(())
            }
            Err(e) => {
                let _ = self.file.set_len(self.len);
                Err(io(&self.path, "appending a record")(e))
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

trait AppendAtEnd {
    fn write_all_at_end(&mut self, bytes: &[u8]) -> std::io::Result<()>;
}

impl AppendAtEnd for File {
    fn write_all_at_end(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::{Seek, SeekFrom};
        self.seek(SeekFrom::End(0))?;
        self.write_all(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rust_decimal::Decimal;
    use txflow_core::events::SpotOp;

    fn record(seq: u64, amount: &str) -> Record {
        Record {
            seq,
            req_id: format!("req-{seq}"),
            op: if seq.is_multiple_of(2) {
                SpotOp::Debit
            } else {
                SpotOp::Credit
            },
            user_id: "u1".into(),
            asset: "USDT".into(),
            amount: amount.into(),
            compensation: false,
            external: seq.is_multiple_of(5),
            code: seq
                .is_multiple_of(3)
                .then(|| "INSUFFICIENT_BALANCE".to_string()),
            balance: Some(Decimal::new(seq as i64 * 1_000_001, 6)),
        }
    }

    fn log(n: u64) -> (Vec<Record>, Vec<u8>) {
        let records: Vec<Record> = (1..=n).map(|s| record(s, "1.25")).collect();
        let bytes = records
            .iter()
            .flat_map(|r| encode(r).expect("encode"))
            .collect();
        (records, bytes)
    }

    fn tmp() -> PathBuf {
        let d = std::env::temp_dir().join(format!("spot-wal-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&d).expect("tmp dir");
        d
    }

    #[test]
    fn an_empty_log_has_no_records() {
        assert_eq!(
            decode_all(&[]).expect("empty"),
            Decoded {
                records: vec![],
                valid_len: 0,
                torn: 0
            }
        );
    }

    #[test]
    fn a_zero_filled_tail_is_torn() {
        let (records, mut bytes) = log(3);
        let valid = bytes.len() as u64;
        bytes.extend_from_slice(&[0u8; 40]);
        let d = decode_all(&bytes).expect("decode");
        assert_eq!(d.records, records);
        assert_eq!((d.valid_len, d.torn), (valid, 40));
    }

    #[test]
    fn a_damaged_record_with_records_after_it_is_corruption() {
        let (_, mut bytes) = log(3);
        let first = encode(&record(1, "1.25")).expect("encode").len();
        bytes[first + HEADER + 2] ^= 0x55; // inside record 2's payload
        assert!(matches!(
            decode_all(&bytes),
            Err(WalError::Corrupt { offset, .. }) if offset == first as u64
        ));
    }

    proptest! {
        #[test]
        fn records_round_trip(n in 0u64..20, amount in "[0-9]{1,12}(\\.[0-9]{1,8})?") {
            let records: Vec<Record> = (1..=n).map(|s| record(s, &amount)).collect();
            let bytes: Vec<u8> = records.iter().flat_map(|r| encode(r).expect("encode")).collect();
            let d = decode_all(&bytes).expect("decode");
            prop_assert_eq!(d.records, records);
            prop_assert_eq!(d.valid_len, bytes.len() as u64);
            prop_assert_eq!(d.torn, 0);
        }

        /// Any cut of the log keeps exactly the records that were complete before it.
        #[test]
        fn a_torn_tail_is_cut_never_misread(n in 1u64..12, cut in any::<prop::sample::Index>()) {
            let (records, bytes) = log(n);
            let cut = cut.index(bytes.len());
            let mut ends = Vec::new();
            let mut at = 0;
            for r in &records {
                at += encode(r).expect("encode").len();
                ends.push(at);
            }
            let complete = ends.iter().filter(|e| **e <= cut).count();
            let d = decode_all(&bytes[..cut]).expect("a torn tail is not corruption");
            prop_assert_eq!(&d.records[..], &records[..complete]);
            let valid = if complete == 0 { 0 } else { ends[complete - 1] };
            prop_assert_eq!(d.valid_len, valid as u64);
            prop_assert_eq!(d.torn, (cut - valid) as u64);
        }

        /// A flipped bit in the last record is caught by the checksum and cut off.
        #[test]
        fn a_flipped_bit_in_the_last_record_is_detected(n in 1u64..8, bit in any::<prop::sample::Index>()) {
            let (records, mut bytes) = log(n);
            let last = encode(&records[n as usize - 1]).expect("encode").len();
            let start = bytes.len() - last;
            let i = start + HEADER + bit.index(last - HEADER);
            bytes[i] ^= 0x01;
            let d = decode_all(&bytes).expect("torn tail");
            prop_assert_eq!(&d.records[..], &records[..n as usize - 1]);
            prop_assert_eq!(d.torn, last as u64);
        }
    }

    #[test]
    fn open_cuts_a_torn_tail_and_appends_after_it() {
        let dir = tmp();
        {
            let mut o = Wal::open(&dir).expect("open");
            for s in 1..=3 {
                o.wal.append(&record(s, "2")).expect("append");
            }
        }
        let path = dir.join(WAL_FILE);
        let full = std::fs::metadata(&path).expect("meta").len();
        let f = OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open file");
        f.set_len(full - 5).expect("tear");
        drop(f);
        let mut o = Wal::open(&dir).expect("reopen");
        assert_eq!(o.records.len(), 2);
        assert!(o.torn > 0);
        o.wal.append(&record(3, "3")).expect("append after the cut");
        drop(o);
        let o = Wal::open(&dir).expect("reopen again");
        assert_eq!(o.records.len(), 3);
        assert_eq!(o.records[2].amount, "3");
        assert_eq!(o.torn, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_second_writer_is_refused() {
        let dir = tmp();
        let first = Wal::open(&dir).expect("first");
        assert!(matches!(Wal::open(&dir), Err(WalError::Locked { .. })));
        drop(first);
        Wal::open(&dir).expect("free again once the first is gone");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

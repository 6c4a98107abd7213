//! librdkafka's default partitioner (`consistent_random`): CRC-32 of the key modulo the number of
//! partitions. The recovery scan uses it to find the signers whose messages land on the
//! partitions assigned to this instance.

const fn table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

static TABLE: [u32; 256] = table();

/// CRC-32 (IEEE 802.3, as zlib and librdkafka compute it).
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for b in bytes {
        c = TABLE[((c ^ u32::from(*b)) & 0xFF) as usize] ^ (c >> 8);
    }
    c ^ 0xFFFF_FFFF
}

/// The partition librdkafka's default partitioner picks for a non-empty `key`.
pub fn partition_for(key: &str, partitions: i32) -> i32 {
    if partitions <= 0 {
        return 0;
    }
    (crc32(key.as_bytes()) % partitions as u32) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }
}

//! Why a call reverted, from its revert data: `Error(string)`, `Panic(uint256)` with the
//! compiler's panic codes, a custom error by its 4-byte selector, or none. Pure: the receipt
//! checker gets the data from an `eth_call` of the transaction at its block.

/// `bytes4(keccak256("Error(string)"))`.
pub const ERROR_SELECTOR: [u8; 4] = [0x08, 0xc3, 0x79, 0xa0];
/// `bytes4(keccak256("Panic(uint256)"))`.
pub const PANIC_SELECTOR: [u8; 4] = [0x4e, 0x48, 0x7b, 0x71];

/// The longest reason kept (a contract's message can be any length).
pub const MAX_REASON_CHARS: usize = 256;

/// The meaning of a Solidity panic code.
pub fn panic_meaning(code: u64) -> &'static str {
    match code {
        0x00 => "generic compiler panic",
        0x01 => "assertion failed",
        0x11 => "arithmetic overflow or underflow",
        0x12 => "division or modulo by zero",
        0x21 => "conversion into an invalid enum value",
        0x22 => "incorrectly encoded storage byte array",
        0x31 => "pop on an empty array",
        0x32 => "array index out of bounds",
        0x41 => "too much memory allocated",
        0x51 => "call to a zero-initialised internal function",
        _ => "unknown panic code",
    }
}

/// A 32-byte ABI word at `at` as a `usize`, if it fits and is there.
fn word(data: &[u8], at: usize) -> Option<usize> {
    let w = data.get(at..at.checked_add(32)?)?;
    if w[..24].iter().any(|b| *b != 0) {
        return None;
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&w[24..]);
    usize::try_from(u64::from_be_bytes(n)).ok()
}

/// The reason `data` (the revert data of a call) gives, readable: `Error("…")`,
/// `Panic(0x11: arithmetic overflow or underflow)`, `custom error 0x…`, or `no reason given`.
/// Never fails: data that does not decode as what its selector says is shown as bytes.
pub fn decode_revert(data: &[u8]) -> String {
    let hex = |b: &[u8]| format!("0x{}", alloy_primitives::hex::encode(b));
    if data.is_empty() {
        return "no reason given".into();
    }
    let Some((selector, args)) = data.split_first_chunk::<4>() else {
        return format!("revert data {}", hex(data));
    };
    if *selector == ERROR_SELECTOR {
        let text = word(args, 0).and_then(|offset| {
            let len = word(args, offset)?;
            let start = offset.checked_add(32)?;
            args.get(start..start.checked_add(len)?)
        });
        return match text {
            Some(t) => {
                let s: String = String::from_utf8_lossy(t)
                    .chars()
                    .take(MAX_REASON_CHARS)
                    .collect();
                format!("Error({s:?})")
            }
            None => format!("Error(string) that does not decode: {}", hex(data)),
        };
    }
    if *selector == PANIC_SELECTOR {
        return match args.get(..32) {
            Some(w) if w[..24].iter().all(|b| *b == 0) => {
                let mut n = [0u8; 8];
                n.copy_from_slice(&w[24..]);
                let code = u64::from_be_bytes(n);
                format!("Panic(0x{code:02x}: {})", panic_meaning(code))
            }
            _ => format!("Panic(uint256) that does not decode: {}", hex(data)),
        };
    }
    format!(
        "custom error {} ({} bytes of arguments)",
        hex(selector),
        args.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn abi_error(text: &str) -> Vec<u8> {
        let mut d = ERROR_SELECTOR.to_vec();
        let mut w = [0u8; 32];
        w[31] = 0x20;
        d.extend_from_slice(&w);
        let mut len = [0u8; 32];
        len[24..].copy_from_slice(&(text.len() as u64).to_be_bytes());
        d.extend_from_slice(&len);
        let mut t = text.as_bytes().to_vec();
        t.resize(text.len().div_ceil(32) * 32, 0);
        d.extend_from_slice(&t);
        d
    }

    fn abi_panic(code: u8) -> Vec<u8> {
        let mut d = PANIC_SELECTOR.to_vec();
        let mut w = [0u8; 32];
        w[31] = code;
        d.extend_from_slice(&w);
        d
    }

    #[test]
    fn each_kind_of_revert_data_reads_as_its_reason() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (Vec::new(), "no reason given"),
            (abi_error("nope"), "Error(\"nope\")"),
            (abi_error(""), "Error(\"\")"),
            (
                abi_error("insufficient allowance for this transfer, try again later"),
                "Error(\"insufficient allowance for this transfer, try again later\")",
            ),
            (
                abi_panic(0x11),
                "Panic(0x11: arithmetic overflow or underflow)",
            ),
            (abi_panic(0x12), "Panic(0x12: division or modulo by zero)"),
            (abi_panic(0x01), "Panic(0x01: assertion failed)"),
            (abi_panic(0x99), "Panic(0x99: unknown panic code)"),
            (
                vec![0xde, 0xad, 0xbe, 0xef, 1, 2, 3],
                "custom error 0xdeadbeef (3 bytes of arguments)",
            ),
            (
                vec![0x12, 0x34, 0x56, 0x78],
                "custom error 0x12345678 (0 bytes of arguments)",
            ),
            (vec![0xab, 0xcd], "revert data 0xabcd"),
        ];
        for (data, want) in cases {
            assert_eq!(
                decode_revert(&data),
                want,
                "{}",
                alloy_primitives::hex::encode(&data)
            );
        }
    }

    #[test]
    fn revert_data_that_lies_about_its_shape_is_shown_not_trusted() {
        // An Error(string) whose length runs past the data.
        let mut d = abi_error("nope");
        d[4 + 32 + 31] = 200;
        assert!(decode_revert(&d).starts_with("Error(string) that does not decode: 0x08c379a0"));
        // A selector and nothing else.
        assert!(decode_revert(&ERROR_SELECTOR).starts_with("Error(string) that does not decode"));
        assert!(decode_revert(&PANIC_SELECTOR).starts_with("Panic(uint256) that does not decode"));
        // A reason longer than the cap is cut.
        let long = "x".repeat(1000);
        let reason = decode_revert(&abi_error(&long));
        assert_eq!(reason, format!("Error({:?})", "x".repeat(MAX_REASON_CHARS)));
    }
}

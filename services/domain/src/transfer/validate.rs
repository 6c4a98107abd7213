//! The checks of seed 004 §1.5, pure, in one place: the gateway, the coordinator and every
//! adapter call these same functions (defence in depth: each layer re-validates what it is
//! given, whatever the caller checked).
//!
//! Amounts are exact decimals ([`rust_decimal::Decimal`]) parsed from a string only: no float,
//! exponent, sign, `NaN` or whitespace is accepted.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use rust_decimal::Decimal;

use super::code::{Rejected, TransferCode};

/// The largest amount any transfer may move, whatever the asset allows: 10^18 (u64::MAX is
/// about 1.8·10^19; the margin keeps sums of balances within `NUMERIC(38, 18)`'s 20 integer
/// digits for many transfers). Above it: `OVERFLOW`.
pub const MAX_SAFE_AMOUNT: Decimal = Decimal::from_parts(0xA764_0000, 0x0DE0_B6B3, 0, false, 0);

/// The most decimal places an asset may have (the scale of the `NUMERIC(38, 18)` columns).
pub const MAX_PLACES: u32 = 18;

/// The longest amount string looked at; a longer one is `OVERFLOW` without parsing.
pub const MAX_AMOUNT_LEN: usize = 64;

/// The longest request id and user id.
pub const MAX_ID_LEN: usize = 64;

/// The account types of §8.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AccountType {
    Funding,
    Spot,
    Future,
    Margin,
}

impl AccountType {
    /// The types a transfer may use now (FUTURE and MARGIN are announced, not launched).
    pub const SUPPORTED: [AccountType; 2] = [AccountType::Funding, AccountType::Spot];

    pub const fn as_str(self) -> &'static str {
        match self {
            AccountType::Funding => "FUNDING",
            AccountType::Spot => "SPOT",
            AccountType::Future => "FUTURE",
            AccountType::Margin => "MARGIN",
        }
    }

    /// Exactly one of the four upper-case names; anything else is `INVALID_ACCOUNT_TYPE`.
    pub fn parse(s: &str) -> Result<AccountType, Rejected> {
        match s {
            "FUNDING" => Ok(AccountType::Funding),
            "SPOT" => Ok(AccountType::Spot),
            "FUTURE" => Ok(AccountType::Future),
            "MARGIN" => Ok(AccountType::Margin),
            _ => Err(Rejected::new(
                TransferCode::InvalidAccountType,
                "the account type is not one of FUNDING, SPOT, FUTURE, MARGIN",
            )),
        }
    }

    pub const fn is_supported(self) -> bool {
        match self {
            AccountType::Funding | AccountType::Spot => true,
            AccountType::Future | AccountType::Margin => false,
        }
    }
}

impl fmt::Display for AccountType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A transfer's direction: the only two a supported pair makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// `transfer_type` 1: FUNDING → SPOT.
    FundingToSpot,
    /// `transfer_type` 2: SPOT → FUNDING.
    SpotToFunding,
}

impl Direction {
    /// The value of `transfers.transfer_type` (§7.1).
    pub const fn transfer_type(self) -> i16 {
        match self {
            Direction::FundingToSpot => 1,
            Direction::SpotToFunding => 2,
        }
    }

    pub const fn source(self) -> AccountType {
        match self {
            Direction::FundingToSpot => AccountType::Funding,
            Direction::SpotToFunding => AccountType::Spot,
        }
    }

    pub const fn target(self) -> AccountType {
        match self {
            Direction::FundingToSpot => AccountType::Spot,
            Direction::SpotToFunding => AccountType::Funding,
        }
    }
}

/// §1.5.2, in the seed's order: `from != to` (`SAME_ACCOUNT`), both known
/// (`INVALID_ACCOUNT_TYPE`), both launched (`UNSUPPORTED_ACCOUNT_TYPE`).
pub fn check_accounts(from: &str, to: &str) -> Result<Direction, Rejected> {
    if from == to {
        return Err(Rejected::new(
            TransferCode::SameAccount,
            "from and to are the same account",
        ));
    }
    let from = AccountType::parse(from)?;
    let to = AccountType::parse(to)?;
    if !from.is_supported() || !to.is_supported() {
        return Err(Rejected::new(
            TransferCode::UnsupportedAccountType,
            "only FUNDING and SPOT transfers are supported",
        ));
    }
    match (from, to) {
        (AccountType::Funding, AccountType::Spot) => Ok(Direction::FundingToSpot),
        (AccountType::Spot, AccountType::Funding) => Ok(Direction::SpotToFunding),
        // Unreachable for supported, distinct types; refused rather than assumed.
        _ => Err(Rejected::new(
            TransferCode::UnsupportedAccountType,
            "only FUNDING and SPOT transfers are supported",
        )),
    }
}

/// A positive amount within [`MAX_SAFE_AMOUNT`], normalised (no trailing zeros). Made only by
/// [`parse_amount`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Amount(Decimal);

impl Amount {
    pub const fn value(self) -> Decimal {
        self.0
    }

    /// Its decimal places (significant: `1.50` has one).
    pub fn places(self) -> u32 {
        self.0.scale()
    }
}

impl fmt::Display for Amount {
    /// The plain decimal (`100`, `0.00000001`), never an exponent: what the SQL binds as text and
    /// casts `::numeric`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The shape of §1.5.3: digits, optionally a `.` and digits; nothing else (no sign, exponent,
/// whitespace, `_`, `NaN`). `-…` and zero are `INVALID_AMOUNT`; a number beyond
/// [`MAX_SAFE_AMOUNT`], or too long or too precise for an exact decimal, is `OVERFLOW`.
/// The asset's own limits are [`check_amount`]'s.
pub fn parse_amount(s: &str) -> Result<Amount, Rejected> {
    let invalid = |why: &str| Rejected::new(TransferCode::InvalidAmount, why.to_string());
    if s.len() > MAX_AMOUNT_LEN {
        return Err(Rejected::new(
            TransferCode::Overflow,
            format!("the amount is longer than {MAX_AMOUNT_LEN} characters"),
        ));
    }
    let (negative, digits) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (int, frac) = match digits.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (digits, None),
    };
    let all_digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(int) || frac.is_some_and(|f| !all_digits(f)) {
        return Err(invalid(
            "the amount is not a plain decimal string (digits, optionally '.' and digits)",
        ));
    }
    if negative {
        return Err(invalid("the amount is negative"));
    }
    // Leading zeros of the integer part and trailing zeros of the fraction carry nothing;
    // dropping them first lets `0001.000…0` (more digits than an exact decimal holds) parse.
    let int = match int.trim_start_matches('0') {
        "" => "0",
        i => i,
    };
    let frac = frac.map(|f| f.trim_end_matches('0')).unwrap_or("");
    if frac.len() > MAX_PLACES as usize {
        return Err(Rejected::new(
            TransferCode::PrecisionOverflow,
            format!("the amount has more than {MAX_PLACES} decimal places"),
        ));
    }
    let trimmed = if frac.is_empty() {
        int.to_string()
    } else {
        format!("{int}.{frac}")
    };
    let value = Decimal::from_str_exact(&trimmed).map_err(|_| {
        Rejected::new(
            TransferCode::Overflow,
            "the amount does not fit an exact decimal",
        )
    })?;
    if value.is_zero() {
        return Err(invalid("the amount is zero"));
    }
    if value > MAX_SAFE_AMOUNT {
        return Err(Rejected::new(
            TransferCode::Overflow,
            format!("the amount is above the safe limit {MAX_SAFE_AMOUNT}"),
        ));
    }
    Ok(Amount(value.normalize()))
}

/// An asset's listing status (§1.5.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AssetStatus {
    Active,
    Suspended,
}

impl AssetStatus {
    pub const fn as_str(self) -> &'static str {
        match self {
            AssetStatus::Active => "ACTIVE",
            AssetStatus::Suspended => "SUSPENDED",
        }
    }

    pub fn parse(s: &str) -> Option<AssetStatus> {
        match s {
            "ACTIVE" => Some(AssetStatus::Active),
            "SUSPENDED" => Some(AssetStatus::Suspended),
            _ => None,
        }
    }
}

/// What §1.5.3 and §1.5.4 need to know about an asset (a row of the `assets` table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssetRule {
    pub asset: String,
    /// Decimal places allowed, at most [`MAX_PLACES`].
    pub places: u32,
    pub min_amount: Decimal,
    pub max_amount: Decimal,
    pub status: AssetStatus,
    pub internal_transfer_enabled: bool,
}

/// An asset rule that cannot be used (a bad row or setting: an operator's error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("asset rule for {asset:?} is invalid: {why}")]
pub struct InvalidAssetRule {
    pub asset: String,
    pub why: &'static str,
}

impl AssetRule {
    /// Checks the rule's own consistency: a well-formed code, places ≤ [`MAX_PLACES`],
    /// `0 < min ≤ max ≤ MAX_SAFE_AMOUNT`, and min and max expressible in the asset's places.
    pub fn validated(self) -> Result<AssetRule, InvalidAssetRule> {
        let bad = |why| InvalidAssetRule {
            asset: self.asset.clone(),
            why,
        };
        if !is_asset_code(&self.asset) {
            return Err(bad("the code is not 1 to 16 upper-case letters or digits"));
        }
        if self.places > MAX_PLACES {
            return Err(bad("more than 18 decimal places"));
        }
        if self.min_amount <= Decimal::ZERO || self.min_amount > self.max_amount {
            return Err(bad("min_amount must be positive and at most max_amount"));
        }
        if self.max_amount > MAX_SAFE_AMOUNT {
            return Err(bad("max_amount is above the safe limit"));
        }
        if self.min_amount.normalize().scale() > self.places {
            return Err(bad("min_amount has more decimal places than the asset"));
        }
        Ok(self)
    }
}

/// An asset code's shape (1 to 16 upper-case letters or digits); `INVALID_ASSET` otherwise.
/// Whether the asset exists is the asset table's question.
pub fn check_asset_code(s: &str) -> Result<&str, Rejected> {
    if is_asset_code(s) {
        Ok(s)
    } else {
        Err(Rejected::new(TransferCode::InvalidAsset, "unknown asset"))
    }
}

fn is_asset_code(s: &str) -> bool {
    (1..=16).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
}

/// §1.5.3 against an asset: `PRECISION_OVERFLOW` (more places than the asset has),
/// `AMOUNT_TOO_SMALL`, `AMOUNT_TOO_LARGE`, in the seed's order.
pub fn check_amount(amount: Amount, rule: &AssetRule) -> Result<Amount, Rejected> {
    if amount.places() > rule.places {
        return Err(Rejected::new(
            TransferCode::PrecisionOverflow,
            format!(
                "{} allows {} decimal places, the amount has {}",
                rule.asset,
                rule.places,
                amount.places()
            ),
        ));
    }
    if amount.value() < rule.min_amount {
        return Err(Rejected::new(
            TransferCode::AmountTooSmall,
            format!("the minimum for {} is {}", rule.asset, rule.min_amount),
        ));
    }
    if amount.value() > rule.max_amount {
        return Err(Rejected::new(
            TransferCode::AmountTooLarge,
            format!("the maximum for {} is {}", rule.asset, rule.max_amount),
        ));
    }
    Ok(amount)
}

/// §1.5.4 for a rule found: `ASSET_SUSPENDED`, `TRANSFER_NOT_ALLOWED`.
pub fn check_asset(rule: &AssetRule) -> Result<(), Rejected> {
    if rule.status != AssetStatus::Active {
        return Err(Rejected::new(
            TransferCode::AssetSuspended,
            format!("{} is suspended", rule.asset),
        ));
    }
    if !rule.internal_transfer_enabled {
        return Err(Rejected::new(
            TransferCode::TransferNotAllowed,
            format!("{} does not allow internal transfers", rule.asset),
        ));
    }
    Ok(())
}

/// The asset rules the gateway and the coordinator validate against (loaded from the `assets`
/// table; the FUNDING adapter reads the row itself, in its own transaction).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AssetTable(BTreeMap<String, AssetRule>);

impl AssetTable {
    pub fn new(rules: impl IntoIterator<Item = AssetRule>) -> Result<AssetTable, InvalidAssetRule> {
        let mut map = BTreeMap::new();
        for rule in rules {
            let rule = rule.validated()?;
            map.insert(rule.asset.clone(), rule);
        }
        Ok(AssetTable(map))
    }

    /// The rule of `asset` (`INVALID_ASSET` when unknown or malformed), not yet checked for
    /// status.
    pub fn rule(&self, asset: &str) -> Result<&AssetRule, Rejected> {
        self.0
            .get(asset)
            .filter(|_| is_asset_code(asset))
            .ok_or_else(|| Rejected::new(TransferCode::InvalidAsset, "unknown asset"))
    }
}

/// A request id or a user id: 1 to [`MAX_ID_LEN`] ASCII letters, digits, `-`, `_`, `.` or `:`
/// (`INVALID_REQUEST` otherwise; no whitespace, nothing a log or a Kafka key would mangle).
pub fn check_id<'a>(what: &'static str, s: &'a str) -> Result<&'a str, Rejected> {
    let ok = (1..=MAX_ID_LEN).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if ok {
        Ok(s)
    } else {
        Err(Rejected::new(
            TransferCode::InvalidRequest,
            format!("the {what} is not 1 to {MAX_ID_LEN} letters, digits, '-', '_', '.' or ':'"),
        ))
    }
}

/// A transfer request as it arrives, every field a string (the gateway's JSON, a command).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRequest<'a> {
    pub user_id: &'a str,
    pub from: &'a str,
    pub to: &'a str,
    pub asset: &'a str,
    pub amount: &'a str,
}

/// A request every stateless check of §1.5 accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidTransfer {
    pub user_id: String,
    pub direction: Direction,
    pub asset: String,
    pub amount: Amount,
}

/// Checks a request in the order of §1.5.8 (format, account types, asset, amount). Identity,
/// rate limits, idempotency and balances are the callers' (they need I/O).
pub fn validate_request(
    req: &TransferRequest<'_>,
    assets: &AssetTable,
) -> Result<ValidTransfer, Rejected> {
    let user_id = check_id("user id", req.user_id)?;
    let direction = check_accounts(req.from, req.to)?;
    let rule = assets.rule(req.asset)?;
    check_asset(rule)?;
    let amount = check_amount(parse_amount(req.amount)?, rule)?;
    Ok(ValidTransfer {
        user_id: user_id.to_string(),
        direction,
        asset: rule.asset.clone(),
        amount,
    })
}

impl FromStr for Amount {
    type Err = Rejected;

    fn from_str(s: &str) -> Result<Amount, Rejected> {
        parse_amount(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(s: &str) -> Decimal {
        Decimal::from_str_exact(s).expect("test decimal")
    }

    fn usdt() -> AssetRule {
        AssetRule {
            asset: "USDT".into(),
            places: 8,
            min_amount: d("0.01"),
            max_amount: d("1000000"),
            status: AssetStatus::Active,
            internal_transfer_enabled: true,
        }
    }

    fn table() -> AssetTable {
        AssetTable::new([
            usdt(),
            AssetRule {
                asset: "OLD".into(),
                status: AssetStatus::Suspended,
                ..usdt()
            },
            AssetRule {
                asset: "LOCK".into(),
                internal_transfer_enabled: false,
                ..usdt()
            },
        ])
        .expect("valid rules")
    }

    fn req<'a>(from: &'a str, to: &'a str, asset: &'a str, amount: &'a str) -> TransferRequest<'a> {
        TransferRequest {
            user_id: "u-1",
            from,
            to,
            asset,
            amount,
        }
    }

    fn code_of(r: &TransferRequest<'_>) -> Option<TransferCode> {
        validate_request(r, &table()).err().map(|e| e.code)
    }

    #[test]
    fn max_safe_amount_is_ten_to_the_eighteen() {
        assert_eq!(MAX_SAFE_AMOUNT, d("1000000000000000000"));
    }

    #[test]
    fn a_valid_request_passes_in_both_directions() {
        let v =
            validate_request(&req("FUNDING", "SPOT", "USDT", "100.50"), &table()).expect("valid");
        assert_eq!(v.direction, Direction::FundingToSpot);
        assert_eq!(v.amount.to_string(), "100.5");
        let v = validate_request(&req("SPOT", "FUNDING", "USDT", "0.01"), &table()).expect("valid");
        assert_eq!(v.direction, Direction::SpotToFunding);
        assert_eq!(v.direction.transfer_type(), 2);
    }

    #[test]
    fn atk_003_negative_amount_is_invalid_amount() {
        assert_eq!(
            code_of(&req("FUNDING", "SPOT", "USDT", "-100")),
            Some(TransferCode::InvalidAmount)
        );
    }

    #[test]
    fn atk_004_zero_amount_is_invalid_amount() {
        for zero in ["0", "0.0", "000", "0.00000000"] {
            assert_eq!(
                code_of(&req("FUNDING", "SPOT", "USDT", zero)),
                Some(TransferCode::InvalidAmount),
                "{zero}"
            );
        }
    }

    #[test]
    fn atk_005_more_places_than_the_asset_is_precision_overflow() {
        assert_eq!(
            code_of(&req("FUNDING", "SPOT", "USDT", "0.000000001")),
            Some(TransferCode::PrecisionOverflow)
        );
        // Trailing zeros are not precision.
        assert!(code_of(&req("FUNDING", "SPOT", "USDT", "1.1000000000000")).is_none());
    }

    #[test]
    fn atk_006_integer_overflow_is_overflow() {
        // u64::MAX + 1, and numbers no exact decimal holds.
        for big in [
            "18446744073709551616",
            "1000000000000000000.00000001",
            "99999999999999999999999999999999",
            &"9".repeat(65),
        ] {
            let r = req("FUNDING", "SPOT", "USDT", big);
            assert_eq!(
                parse_amount(r.amount).err().map(|e| e.code),
                Some(TransferCode::Overflow),
                "{big}"
            );
        }
    }

    #[test]
    fn atk_007_same_account_is_same_account() {
        assert_eq!(
            code_of(&req("SPOT", "SPOT", "USDT", "1")),
            Some(TransferCode::SameAccount)
        );
    }

    #[test]
    fn atk_008_invalid_account_type_is_invalid_account_type() {
        for (from, to) in [("INVALID", "SPOT"), ("FUNDING", "spot"), ("", "SPOT")] {
            assert_eq!(
                code_of(&req(from, to, "USDT", "1")),
                Some(TransferCode::InvalidAccountType),
                "{from} -> {to}"
            );
        }
    }

    #[test]
    fn announced_account_types_are_unsupported() {
        assert_eq!(
            code_of(&req("FUNDING", "FUTURE", "USDT", "1")),
            Some(TransferCode::UnsupportedAccountType)
        );
        assert_eq!(
            code_of(&req("MARGIN", "SPOT", "USDT", "1")),
            Some(TransferCode::UnsupportedAccountType)
        );
    }

    #[test]
    fn atk_009_unknown_asset_is_invalid_asset() {
        for asset in ["999999", "usdt", "", "USDT ", "NOPE"] {
            assert_eq!(
                code_of(&req("FUNDING", "SPOT", asset, "1")),
                Some(TransferCode::InvalidAsset),
                "{asset:?}"
            );
        }
    }

    #[test]
    fn suspended_asset_and_forbidden_transfer() {
        assert_eq!(
            code_of(&req("FUNDING", "SPOT", "OLD", "1")),
            Some(TransferCode::AssetSuspended)
        );
        assert_eq!(
            code_of(&req("FUNDING", "SPOT", "LOCK", "1")),
            Some(TransferCode::TransferNotAllowed)
        );
    }

    #[test]
    fn amount_limits_of_the_asset() {
        assert_eq!(
            code_of(&req("FUNDING", "SPOT", "USDT", "0.009")),
            Some(TransferCode::AmountTooSmall)
        );
        assert_eq!(
            code_of(&req("FUNDING", "SPOT", "USDT", "1000000.00000001")),
            Some(TransferCode::AmountTooLarge)
        );
        assert!(code_of(&req("FUNDING", "SPOT", "USDT", "1000000")).is_none());
        assert!(code_of(&req("FUNDING", "SPOT", "USDT", "0.01")).is_none());
    }

    #[test]
    fn floats_exponents_and_other_shapes_are_invalid_amount() {
        for bad in [
            "1e5", "1E5", "NaN", "nan", "inf", "Infinity", "+1", " 1", "1 ", "1_000", "1,5", ".5",
            "5.", "0x10", "1.2.3", "--1", "", "١",
        ] {
            assert_eq!(
                parse_amount(bad).err().map(|e| e.code),
                Some(TransferCode::InvalidAmount),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn ids_are_bounded_and_plain() {
        assert!(check_id("user id", "user-42_a.b:c").is_ok());
        for bad in ["", "a b", "é", &"x".repeat(65), "a\n"] {
            assert_eq!(
                check_id("user id", bad).err().map(|e| e.code),
                Some(TransferCode::InvalidRequest),
                "{bad:?}"
            );
        }
        assert_eq!(
            validate_request(
                &TransferRequest {
                    user_id: "",
                    ..req("FUNDING", "SPOT", "USDT", "1")
                },
                &table()
            )
            .err()
            .map(|e| e.code),
            Some(TransferCode::InvalidRequest)
        );
    }

    #[test]
    fn asset_rules_are_checked_when_loaded() {
        let bad = [
            AssetRule {
                places: 19,
                ..usdt()
            },
            AssetRule {
                min_amount: d("0"),
                ..usdt()
            },
            AssetRule {
                min_amount: d("2000000"),
                ..usdt()
            },
            AssetRule {
                max_amount: d("10000000000000000000"),
                ..usdt()
            },
            AssetRule {
                min_amount: d("0.000000001"),
                ..usdt()
            },
            AssetRule {
                asset: "usdt".into(),
                ..usdt()
            },
        ];
        for rule in bad {
            assert!(AssetTable::new([rule.clone()]).is_err(), "{rule:?}");
        }
    }

    proptest! {
        /// Every well-formed positive decimal of at most 8 places and 12 integer digits parses
        /// to itself, exactly.
        #[test]
        fn plain_decimals_parse_exactly(int in 0u64..1_000_000_000_000, frac in 0u32..100_000_000) {
            let s = format!("{int}.{frac:08}");
            let expected = d(&s);
            match parse_amount(&s) {
                Ok(a) => prop_assert_eq!(a.value(), expected),
                Err(e) => {
                    prop_assert!(expected.is_zero());
                    prop_assert_eq!(e.code, TransferCode::InvalidAmount);
                }
            }
        }

        /// Whatever the string, parsing never panics, and what it accepts is positive, within
        /// the safe range, and prints back as a plain decimal that parses to the same amount.
        #[test]
        fn any_string_is_accepted_only_as_a_safe_positive_decimal(s in "\\PC{0,40}|[-+.0-9eE]{0,30}") {
            if let Ok(a) = parse_amount(&s) {
                prop_assert!(a.value() > Decimal::ZERO && a.value() <= MAX_SAFE_AMOUNT);
                let printed = a.to_string();
                prop_assert!(printed.bytes().all(|b| b.is_ascii_digit() || b == b'.'));
                prop_assert_eq!(parse_amount(&printed).map(|b| b.value()), Ok(a.value()));
            }
        }
    }
}

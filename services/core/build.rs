// `sqlx::migrate!` (db.rs) embeds ../../migrations at compile time, but cargo does not know the
// directory is an input: without this, a new migration file is left out of an incremental build.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}

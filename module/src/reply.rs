//! A command's reply, before the server's types: integers of any size the core
//! computes (sent as integers within i64, as decimal strings beyond), nil, and
//! arrays; per-entry errors for a batch.

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Int(i128),
    Nil,
    Array(Vec<Reply>),
    /// An error in place of one allow of a batch (the others go on).
    Error(&'static str),
}

impl Reply {
    #[must_use]
    pub fn ints<const N: usize>(values: [i128; N]) -> Reply {
        Reply::Array(values.into_iter().map(Reply::Int).collect())
    }
}

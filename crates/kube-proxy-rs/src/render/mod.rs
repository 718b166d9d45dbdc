//! Text for people: what kp-model returns as data (an explanation, the
//! programmed state), written as `explain` and `status` print it. The JSON
//! forms are the data's serde.

mod explain;
mod status;

pub use explain::explain_text;
pub use status::status_table;

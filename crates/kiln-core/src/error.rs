use std::fmt;

/// Every fallible kiln operation returns this. Variants name the kind of failure; the
/// message says what and where, so that a caller can print it as one line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or buffer whose contents break its format (with the position in the message).
    #[error("{0}")]
    Format(String),
    /// Shapes or lengths that do not fit the operation.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// Something valid that kiln does not implement (a dtype for an op, a format version).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A device could not do what was asked (missing, out of memory, wrong device).
    #[error("device error: {0}")]
    Device(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn format(msg: impl fmt::Display) -> Self {
        Error::Format(msg.to_string())
    }
    pub fn shape(msg: impl fmt::Display) -> Self {
        Error::Shape(msg.to_string())
    }
    pub fn unsupported(msg: impl fmt::Display) -> Self {
        Error::Unsupported(msg.to_string())
    }
    pub fn io(context: impl fmt::Display, source: std::io::Error) -> Self {
        Error::Io {
            context: context.to_string(),
            source,
        }
    }
}

//! What can go wrong while drawing a picture.

use std::path::PathBuf;

/// Why a picture was not drawn.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlotError {
    /// The file name's extension is neither `.svg` nor `.png`.
    #[error("cannot tell the picture format of {path}: its name must end in .svg or .png")]
    Format {
        /// The file asked for.
        path: PathBuf,
    },
    /// There is no data point at all (every series is empty, or there are no series).
    #[error("nothing to draw in {path}: {what}")]
    Empty {
        /// The file asked for.
        path: PathBuf,
        /// What was missing.
        what: String,
    },
    /// A value cannot be drawn (not finite, a phase that ends before it starts, ...).
    #[error("cannot draw {path}: {what}")]
    Invalid {
        /// The file asked for.
        path: PathBuf,
        /// The offending value, described.
        what: String,
    },
    /// No TrueType font was found for the picture's text.
    #[error(
        "no font for the picture's text: install Debian's fonts-dejavu-core or set \
         FARMAP_PLOT_FONT to a .ttf file (tried {tried})"
    )]
    NoFont {
        /// The files tried, comma-separated, with why each failed.
        tried: String,
    },
    /// The plotting library or the file system failed.
    #[error("cannot draw {path}")]
    Draw {
        /// The file asked for.
        path: PathBuf,
        /// The plotting library's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

//! The file side: format from the extension, the backend, the font, shared styling.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::PlotError;

/// Width of every picture, in pixels.
pub const WIDTH: u32 = 1000;
/// Height of every picture, in pixels.
pub const HEIGHT: u32 = 600;

/// What a drawing function returns inside this crate (plotters' errors, boxed).
pub(crate) type DrawResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A picture's file format, from its name's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Scalable vector graphics (`.svg`): text stays text.
    Svg,
    /// A bitmap (`.png`), `WIDTH` × `HEIGHT`.
    Png,
}

impl Format {
    /// The format `path`'s extension names (case-insensitive).
    pub fn from_path(path: &Path) -> Result<Self, PlotError> {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("svg") => Ok(Self::Svg),
            Some("png") => Ok(Self::Png),
            _ => Err(PlotError::Format {
                path: path.to_path_buf(),
            }),
        }
    }
}

/// One kind of picture: draws itself on any plotters backend.
pub(crate) trait Picture {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static;
}

/// Draws `picture` into `path` in the format its extension names.
pub(crate) fn render(path: &Path, picture: &impl Picture) -> Result<(), PlotError> {
    let format = Format::from_path(path)?;
    ensure_font()?;
    let failed = |source| PlotError::Draw {
        path: path.to_path_buf(),
        source,
    };
    match format {
        Format::Svg => {
            let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
            draw_on(&root, picture).map_err(failed)
        }
        Format::Png => {
            let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
            draw_on(&root, picture).map_err(failed)
        }
    }
}

fn draw_on<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, picture: &impl Picture) -> DrawResult
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    picture.draw(root)?;
    root.present()?;
    Ok(())
}

/// Where a sans-serif TrueType font usually is: Debian/Ubuntu, Fedora, Arch, then others.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
];

/// The environment variable naming a font file to use instead.
const FONT_ENV: &str = "FARMAP_PLOT_FONT";

/// Registers the system's font as plotters' "sans-serif", once per process.
fn ensure_font() -> Result<(), PlotError> {
    static FONT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = FONT.get_or_init(|| {
        let candidates: Vec<PathBuf> = match std::env::var_os(FONT_ENV) {
            Some(path) => vec![PathBuf::from(path)],
            None => FONT_PATHS.iter().map(PathBuf::from).collect(),
        };
        let mut tried = Vec::new();
        for path in candidates {
            match std::fs::read(&path) {
                Ok(bytes) => {
                    // Leaked once per process: plotters keeps fonts as `&'static [u8]`.
                    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                    if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                        return Ok(path);
                    }
                    tried.push(format!("{}: not a TrueType font", path.display()));
                }
                Err(e) => tried.push(format!("{}: {e}", path.display())),
            }
        }
        Err(tried.join(", "))
    });
    match found {
        Ok(_) => Ok(()),
        Err(tried) => Err(PlotError::NoFont {
            tried: tried.clone(),
        }),
    }
}

/// Colours of the series, in order: distinct for common colour blindness (Okabe–Ito).
pub(crate) fn series_color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 7] = [
        RGBColor(0, 114, 178),
        RGBColor(213, 94, 0),
        RGBColor(0, 158, 115),
        RGBColor(204, 121, 167),
        RGBColor(230, 159, 0),
        RGBColor(86, 180, 233),
        RGBColor(0, 0, 0),
    ];
    COLORS[i % COLORS.len()]
}

/// The title's font.
pub(crate) fn title_font() -> TextStyle<'static> {
    ("sans-serif", 26).into_font().into()
}

/// Axis descriptions, tick labels, legends.
pub(crate) const LABEL_SIZE: u32 = 18;
pub(crate) const TICK_SIZE: u32 = 15;

/// Checks that every value is finite.
pub(crate) fn check_finite(path: &Path, what: &str, values: &[f64]) -> Result<(), PlotError> {
    match values.iter().find(|v| !v.is_finite()) {
        None => Ok(()),
        Some(v) => Err(PlotError::Invalid {
            path: path.to_path_buf(),
            what: format!("{what} has the value {v}"),
        }),
    }
}

/// A number for a tick label: no trailing zeros, short.
pub(crate) fn short_number(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let a = v.abs();
    if !(1e-3..1e6).contains(&a) {
        return format!("{v:.0e}");
    }
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_follows_the_extension() {
        assert_eq!(Format::from_path(Path::new("a.svg")).unwrap(), Format::Svg);
        assert_eq!(
            Format::from_path(Path::new("a/b.PNG")).unwrap(),
            Format::Png
        );
        for bad in ["a.jpg", "a", "svg", "a.svg.txt"] {
            let err = Format::from_path(Path::new(bad)).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains(".svg") && msg.contains(".png") && msg.contains(bad),
                "{msg}"
            );
        }
    }

    #[test]
    fn short_numbers_read_well() {
        assert_eq!(short_number(0.0), "0");
        assert_eq!(short_number(1.0), "1");
        assert_eq!(short_number(0.01), "0.01");
        assert_eq!(short_number(2.5), "2.5");
        assert_eq!(short_number(1e-4), "1e-4");
        assert_eq!(short_number(100_000.0), "100000");
        assert_eq!(short_number(1e7), "1e7");
    }
}

//! `--plot FILE.png`: the CDFs of TTFT and ITL and output tokens/s over time, in one PNG
//! (plotters' bitmap backend; text with an embedded DejaVu Sans through `ab_glyph`, so no system
//! font or fontconfig is needed).

use crate::report::Report;
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

/// DejaVu Sans (license in `assets/DejaVuSans.LICENSE`).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

fn register_font() -> Result<()> {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *ONCE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded font does not load"))
    }
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e}")
}

/// Points of the empirical CDF of `v` (sorted in place), at most ~2000 of them.
fn cdf_points(v: &mut [f64]) -> Vec<(f64, f64)> {
    v.sort_unstable_by(f64::total_cmp);
    let n = v.len();
    let step = n.div_ceil(2000).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (v[i], (i + 1) as f64 / n as f64))
        .collect();
    if let Some(&last) = v.last() {
        pts.push((last, 1.0));
    }
    pts
}

/// Output tokens/s in `bins` equal time bins over the run: (bin centre s, tokens/s).
/// A request's tokens are spread evenly over its chunks, each at its arrival time.
pub fn throughput_series(r: &Report, bins: usize) -> Vec<(f64, f64)> {
    let dur = r.duration_s.max(1e-6);
    let w = dur / bins as f64;
    let mut counts = vec![0f64; bins];
    for q in r.requests.iter().filter(|q| q.ok && q.chunks > 0) {
        let per_chunk = q.output_tokens as f64 / q.chunks as f64;
        let mut t = q.start_s + q.ttft_ms / 1e3;
        let mut add = |t: f64| {
            let b = ((t / w) as usize).min(bins - 1);
            counts[b] += per_chunk;
        };
        add(t);
        for g in &q.itl_ms {
            t += g / 1e3;
            add(t);
        }
    }
    counts
        .iter()
        .enumerate()
        .map(|(i, c)| ((i as f64 + 0.5) * w, c / w))
        .collect()
}

/// Draws the three panels of `r` into a PNG at `path`; `title` heads the image.
///
/// # Errors
/// A font or file error.
pub fn draw(path: &Path, r: &Report, title: &str) -> Result<()> {
    register_font()?;
    let root = BitMapBackend::new(path, (1800, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 24)).map_err(err)?;
    let panels = root.split_evenly((1, 3));
    let mut ttft: Vec<f64> = r
        .requests
        .iter()
        .filter(|q| q.ok)
        .map(|q| q.ttft_ms)
        .collect();
    let mut itl: Vec<f64> = r
        .requests
        .iter()
        .filter(|q| q.ok)
        .flat_map(|q| q.itl_ms.iter().copied())
        .collect();
    cdf_panel(
        &panels[0],
        "TTFT: cumulative distribution",
        "time to first token (ms)",
        &mut ttft,
        &BLUE,
        "TTFT",
    )?;
    cdf_panel(
        &panels[1],
        "ITL: cumulative distribution",
        "inter-token latency (ms)",
        &mut itl,
        &RED,
        "ITL",
    )?;
    let series = throughput_series(r, 60);
    let ymax = series.iter().map(|p| p.1).fold(1.0f64, f64::max) * 1.15;
    let xmax = r.duration_s.max(1e-3);
    let mut chart = ChartBuilder::on(&panels[2])
        .caption("Output throughput over time", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(75)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("output tokens/s")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()
        .map_err(err)?;
    chart
        .draw_series(LineSeries::new(series, GREEN.stroke_width(2)))
        .map_err(err)?
        .label(format!("{} s bins", fmt_num(xmax / 60.0)))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], GREEN.stroke_width(2)));
    let mean = r.output_throughput;
    chart
        .draw_series(LineSeries::new(
            vec![(0.0, mean), (xmax, mean)],
            BLACK.stroke_width(1),
        ))
        .map_err(err)?
        .label(format!("mean {mean:.0} tok/s"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

fn fmt_num(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.0}")
    } else if x >= 1.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

fn cdf_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    xdesc: &str,
    v: &mut [f64],
    color: &RGBColor,
    name: &str,
) -> Result<()> {
    let pts = cdf_points(v);
    let p50 = crate::stats::percentile(v, 50.0);
    let p99 = crate::stats::percentile(v, 99.0);
    // Clip the x axis at 1.25 × p99.9 so that a few outliers do not squash the curve.
    let max = v.last().copied().unwrap_or(1.0).max(1e-3);
    let max = (crate::stats::percentile(v, 99.9) * 1.25).clamp(1e-3, max);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..max * 1.02, 0f64..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(format!("{xdesc}, axis cut at 1.25 × p99.9"))
        .y_desc("fraction of samples ≤ x")
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()
        .map_err(err)?;
    chart
        .draw_series(LineSeries::new(pts, color.stroke_width(2)))
        .map_err(err)?
        .label(format!("{name} (n = {})", v.len()))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    for (q, val, style) in [
        ("p50", p50, BLACK.stroke_width(1)),
        ("p99", p99, MAGENTA.stroke_width(1)),
    ] {
        if val.is_finite() {
            chart
                .draw_series(LineSeries::new(vec![(val, 0.0), (val, 1.0)], style))
                .map_err(err)?
                .label(format!("{q} = {} ms", fmt_num(val)))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_ends_at_one_and_is_monotone() {
        let mut v: Vec<f64> = (0..5000).map(|i| ((i * 7919) % 5000) as f64).collect();
        let p = cdf_points(&mut v);
        assert!(p.len() <= 2002);
        assert_eq!(p.last().unwrap(), &(4999.0, 1.0));
        assert!(p.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
    }
}

//! SVG figures for docs/benchmarks.md, drawn with plotters.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xe3, 0x77, 0xc2),
];

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing: {e:?}")
}

/// Lines over a logarithmic x axis (the number of Services).
pub fn log_x_lines(path: &Path, title: &str, x_desc: &str, y_desc: &str, lines: &[Line]) -> Result<()> {
    let xs = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    let x_max = xs.clone().fold(1.0, f64::max) * 2.0;
    let x_min = xs.fold(f64::INFINITY, f64::min).max(0.5) / 2.0;
    let y_max = lines.iter().flat_map(|l| l.points.iter().map(|p| p.1)).fold(1.0, f64::max) * 1.2;
    let root = SVGBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d((x_min..x_max).log_scale(), 0f64..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(err)?;
    for (i, line) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(line.points.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(line.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(line.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

pub struct Panel {
    pub title: String,
    /// (bar label, value)
    pub bars: Vec<(String, f64)>,
}

/// One bar chart per panel, two panels a row.
pub fn bar_panels(path: &Path, title: &str, y_desc: &str, panels: &[Panel]) -> Result<()> {
    let rows = panels.len().div_ceil(2);
    let root = SVGBackend::new(path, (1000, 330 * rows as u32 + 40)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(err)?;
    let areas = root.split_evenly((rows, 2));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let n = panel.bars.len() as i32;
        let y_max = panel.bars.iter().map(|b| b.1).fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(70)
            .build_cartesian_2d((0..n).into_segmented(), 0f64..y_max)
            .map_err(err)?;
        let labels: Vec<String> = panel.bars.iter().map(|b| b.0.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(y_desc)
            .y_label_formatter(&|v| si(*v))
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .draw()
            .map_err(err)?;
        for (i, (_, value)) in panel.bars.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(Histogram::vertical(&chart).style(color.filled()).margin(8).data([(i as i32, *value)]))
                .map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// 12345 -> "12.3k".
pub fn si(v: f64) -> String {
    match v.abs() {
        a if a >= 1e6 => format!("{:.1}M", v / 1e6),
        a if a >= 1e3 => format!("{:.1}k", v / 1e3),
        _ => format!("{v:.0}"),
    }
}

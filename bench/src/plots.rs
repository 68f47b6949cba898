//! The report's SVG plots (plotters, SVG backend only): the latency CDF per
//! mode on a log axis, and CPU and memory against the number of containers.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use crate::results::Results;

const COLOURS: [RGBColor; 5] = [BLACK, BLUE, RED, GREEN, MAGENTA];

/// The points of an empirical CDF: (sample, fraction at or below it).
pub fn cdf(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut sorted: Vec<f64> = samples.iter().copied().filter(|v| *v > 0.0).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len() as f64;
    sorted
        .into_iter()
        .enumerate()
        .map(|(i, v)| (v, (i + 1) as f64 / n))
        .collect()
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("plot: {e}")
}

/// The latency CDF of `workload`: each mode's `event` stage and the floor.
pub fn latency_cdf(r: &Results, workload: &str, file: &Path) -> Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = r
        .latency
        .iter()
        .filter(|l| l.workload == workload && (l.stage == "event" || l.mode == "floor"))
        .map(|l| (format!("{} ({})", l.mode, l.stage), cdf(&l.samples_us)))
        .filter(|(_, p)| !p.is_empty())
        .collect();
    let lo = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|x| x.0))
        .fold(f64::INFINITY, f64::min)
        .max(1.0);
    let hi = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|x| x.0))
        .fold(1.0, f64::max);
    let root = SVGBackend::new(file, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Death latency CDF, {workload} (from the kernel's exit)"),
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo / 1.5..hi * 1.5).log_scale(), 0.0..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("microseconds (log)")
        .y_desc("fraction of deaths")
        .draw()
        .map_err(err)?;
    for (i, (name, points)) in series.into_iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// One idle figure against the number of containers, a line per mode.
pub fn idle_against_n(
    r: &Results,
    what: &str,
    pick: fn(&crate::results::Idle) -> f64,
    file: &Path,
) -> Result<()> {
    let mut modes: Vec<&str> = r.idle.iter().map(|i| i.mode.as_str()).collect();
    modes.dedup();
    modes.sort_unstable();
    modes.dedup();
    let max_n = r.idle.iter().map(|i| i.containers).max().unwrap_or(1) as f64;
    let max_y = r.idle.iter().map(pick).fold(0.0, f64::max).max(1e-3) * 1.2;
    let root = SVGBackend::new(file, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{what} against idle containers"),
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_n * 1.05, 0.0..max_y)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("running containers")
        .y_desc(what)
        .draw()
        .map_err(err)?;
    for (i, mode) in modes.into_iter().enumerate() {
        let colour = COLOURS[(i + 1) % COLOURS.len()];
        let points: Vec<(f64, f64)> = r
            .idle
            .iter()
            .filter(|x| x.mode == mode)
            .map(|x| (x.containers as f64, pick(x)))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
            .map_err(err)?
            .label(mode)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, colour.filled())),
            )
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Draws every plot into `dir`; returns (title, path relative to `docs/`).
pub fn all(r: &Results, dir: &Path) -> Result<Vec<(String, String)>> {
    std::fs::create_dir_all(dir)?;
    let rel = |name: &str| format!("../bench/results/{name}");
    let mut out = Vec::new();
    for workload in ["self-exit", "killed", "churn"] {
        if !r.latency.iter().any(|l| l.workload == workload) {
            continue;
        }
        let name = format!("latency-cdf-{workload}.svg");
        latency_cdf(r, workload, &dir.join(&name))?;
        out.push((format!("Death latency CDF, {workload}"), rel(&name)));
    }
    if !r.idle.is_empty() {
        idle_against_n(
            r,
            "PLEG process CPU (% of a core)",
            |i| i.agent_cpu_pct.median,
            &dir.join("idle-cpu.svg"),
        )?;
        out.push((
            "PLEG process CPU against idle containers".into(),
            rel("idle-cpu.svg"),
        ));
        idle_against_n(
            r,
            "containerd CPU (% of a core)",
            |i| i.containerd_cpu_pct.median,
            &dir.join("idle-containerd-cpu.svg"),
        )?;
        out.push((
            "containerd CPU against idle containers".into(),
            rel("idle-containerd-cpu.svg"),
        ));
        idle_against_n(
            r,
            "benchmark process RSS, PLEG in-process (MiB)",
            |i| i.agent_rss_mib.median,
            &dir.join("idle-rss.svg"),
        )?;
        out.push((
            "Benchmark process memory (the PLEG in-process) against idle containers".into(),
            rel("idle-rss.svg"),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_is_sorted_and_ends_at_one() {
        assert_eq!(
            cdf(&[30.0, 10.0, 20.0, 40.0]),
            vec![(10.0, 0.25), (20.0, 0.5), (30.0, 0.75), (40.0, 1.0)]
        );
        // Zero cannot sit on a log axis.
        assert_eq!(cdf(&[0.0, 5.0]), vec![(5.0, 1.0)]);
        assert!(cdf(&[]).is_empty());
    }
}

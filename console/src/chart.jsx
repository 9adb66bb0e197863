// A line chart in plain SVG (no chart library, no inline style: colours are
// presentation attributes and classes). Each series is `{name, points:
// [[t, v], ...]}`; time runs left to right over the samples' span. The
// numbers are also in a visually hidden table for screen readers.

const W = 640;
const H = 180;
const PAD = { l: 48, r: 8, t: 8, b: 22 };

function fmt(v, unit) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (unit === "%") return `${(v * 100).toFixed(0)}%`;
  if (unit === "ms") return `${v.toFixed(v < 10 ? 1 : 0)} ms`;
  return Number.isInteger(v) ? String(v) : v.toFixed(2);
}

export function LineChart({ title, series, unit = "", max, testid }) {
  const pts = series.flatMap((s) => s.points);
  const t0 = pts.length ? Math.min(...pts.map((p) => p[0])) : 0;
  const t1 = pts.length ? Math.max(...pts.map((p) => p[0])) : 1;
  const vmax = max ?? Math.max(unit === "ms" ? 10 : 1, ...pts.map((p) => p[1]).filter((v) => Number.isFinite(v)));
  const x = (t) => PAD.l + ((t - t0) / Math.max(1, t1 - t0)) * (W - PAD.l - PAD.r);
  const y = (v) => H - PAD.b - (v / vmax) * (H - PAD.t - PAD.b);
  const last = (s) => (s.points.length ? s.points[s.points.length - 1][1] : null);
  return (
    <figure class="chart" data-testid={testid}>
      <figcaption>{title}</figcaption>
      <svg viewBox={`0 0 ${W} ${H}`} role="img" aria-label={`${title}: ${series.map((s) => `${s.name} ${fmt(last(s), unit)}`).join(", ")}`}>
        <line class="axis" x1={PAD.l} y1={H - PAD.b} x2={W - PAD.r} y2={H - PAD.b} />
        <line class="axis" x1={PAD.l} y1={PAD.t} x2={PAD.l} y2={H - PAD.b} />
        <text class="tick" x={PAD.l - 4} y={PAD.t + 10} text-anchor="end">{fmt(vmax, unit)}</text>
        <text class="tick" x={PAD.l - 4} y={H - PAD.b} text-anchor="end">{fmt(0, unit)}</text>
        <text class="tick" x={W - PAD.r} y={H - 6} text-anchor="end">{pts.length ? `${Math.round((t1 - t0) / 1000)} s` : "no samples yet"}</text>
        {series.map((s, i) => (
          s.points.length > 1
            ? <polyline key={s.name} class={`line line-${i % 6}`} fill="none" points={s.points.filter((p) => Number.isFinite(p[1])).map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ")} />
            : s.points.length === 1 ? <circle key={s.name} class={`dot line-${i % 6}`} cx={x(s.points[0][0])} cy={y(s.points[0][1])} r="3" /> : null
        ))}
      </svg>
      <ul class="legend">
        {series.map((s, i) => <li key={s.name}><span class={`swatch line-${i % 6}`} aria-hidden="true" />{s.name}: <strong data-series={s.name}>{fmt(last(s), unit)}</strong></li>)}
      </ul>
    </figure>
  );
}

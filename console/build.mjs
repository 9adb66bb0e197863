// Bundles the console into dist/: app.js (Preact + the pages, minified, no
// inline script so the CSP can stay `default-src 'self'`), app.css (with
// xterm.js's stylesheet), index.html.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = dirname(fileURLToPath(import.meta.url));
const out = join(root, "dist");
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
await build({
  // the terminal emulator (xterm.js, most of the bytes) is its own chunk,
  // loaded when a terminal is opened
  entryPoints: { app: join(root, "src/main.jsx") },
  outdir: out,
  splitting: true,
  chunkNames: "chunk-[hash]",
  bundle: true,
  format: "esm",
  minify: true,
  sourcemap: false,
  target: ["es2022"],
  jsx: "automatic",
  jsxImportSource: "preact",
  legalComments: "none",
  logLevel: "warning",
});
// the console's styles and xterm.js's (imported by app.css) in one file
await build({
  entryPoints: [join(root, "src/app.css")],
  outfile: join(out, "app.css"),
  bundle: true,
  minify: true,
  logLevel: "warning",
});
copyFileSync(join(root, "index.html"), join(out, "index.html"));

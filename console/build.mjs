// Bundles the console into dist/: app.js (Preact + the pages, minified, no
// inline script so the CSP can stay `default-src 'self'`), app.css, index.html.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = dirname(fileURLToPath(import.meta.url));
const out = join(root, "dist");
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
await build({
  entryPoints: [join(root, "src/main.jsx")],
  outfile: join(out, "app.js"),
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
copyFileSync(join(root, "src/app.css"), join(out, "app.css"));
copyFileSync(join(root, "index.html"), join(out, "index.html"));

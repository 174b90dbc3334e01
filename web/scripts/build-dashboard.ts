/**
 * Builds the dashboard into gateway/static/ (index.html, dashboard.js, dashboard.css), the
 * package data `streamgate serve` serves at `/`. The built files are committed, so a
 * `pip install` serves the dashboard with no Node; `--check` fails when they differ from
 * a fresh build of src/.
 *
 *   npm run build:dashboard            # write
 *   npm run build:dashboard -- --check # CI: the committed bundle must match
 */
import {readFileSync, writeFileSync, mkdirSync} from 'node:fs'
import {dirname, join, relative} from 'node:path'
import {fileURLToPath} from 'node:url'
import {gzipSync} from 'node:zlib'
import {build} from 'esbuild'

const web = join(dirname(fileURLToPath(import.meta.url)), '..')
const out = join(web, '..', 'gateway', 'static')
const assets = join(out, 'assets')

const result = await build({
  entryPoints: {dashboard: join(web, 'src', 'dashboard', 'main.ts')},
  bundle: true,
  minify: true,
  format: 'esm',
  target: ['es2022', 'chrome109', 'firefox115', 'safari16'],
  charset: 'utf8',
  legalComments: 'eof',
  outdir: assets,
  write: false,
  logLevel: 'warning',
})

const files = new Map<string, Uint8Array>(result.outputFiles.map((f) => [f.path, f.contents]))
files.set(join(out, 'index.html'), readFileSync(join(web, 'src', 'dashboard', 'index.html')))

const check = process.argv.includes('--check')
let stale: string[] = []
for (const [path, contents] of files) {
  const name = relative(join(web, '..'), path)
  if (check) {
    let current: Buffer | undefined
    try {
      current = readFileSync(path)
    } catch {}
    if (!current || !current.equals(contents)) stale.push(name)
  } else {
    mkdirSync(dirname(path), {recursive: true})
    writeFileSync(path, contents)
  }
  console.log(`${name}: ${contents.length} bytes, ${gzipSync(contents).length} gzipped`)
}
if (stale.length) {
  console.error(`out of date with web/src: ${stale.join(', ')}; run \`npm run build:dashboard\` in web/`)
  process.exit(1)
}
if (check) console.log('the committed dashboard matches a fresh build')

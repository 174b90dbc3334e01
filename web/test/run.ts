/**
 * `npm test`'s runner: builds the tiny model once for every file that starts a gateway,
 * then runs node's test runner on test/*.test.ts (or the files given).
 */
import {spawnSync} from 'node:child_process'
import {readdirSync, rmSync} from 'node:fs'
import {dirname, join} from 'node:path'

import {tinyModel, WEB} from './support/gateway.ts'

const started = Date.now()
const givenModel = process.env.STREAMGATE_TINY_MODEL
const model = tinyModel()
process.env.STREAMGATE_TINY_MODEL = model
console.log(`tiny model at ${model} (${Date.now() - started} ms)`)

const given = process.argv.slice(2)
const files = given.length
  ? given
  : readdirSync(join(WEB, 'test'))
      .filter((f) => f.endsWith('.test.ts'))
      .sort()
      .map((f) => join('test', f))
const run = spawnSync(process.execPath, ['--import', 'tsx', '--test', '--test-reporter', 'spec', ...files], {
  cwd: WEB,
  stdio: 'inherit',
  env: process.env,
})
if (model !== givenModel) rmSync(dirname(model), {recursive: true, force: true})
process.exit(run.status ?? 1)

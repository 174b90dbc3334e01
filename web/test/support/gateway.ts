/** A real gateway for tests: `streamgate serve` on the tiny model (or another), on a free loopback port. */
import {execFileSync, spawn, type ChildProcess} from 'node:child_process'
import {cpSync, existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync} from 'node:fs'
import {createServer} from 'node:net'
import {tmpdir} from 'node:os'
import {dirname, join} from 'node:path'
import {fileURLToPath} from 'node:url'

export const WEB = join(dirname(fileURLToPath(import.meta.url)), '..', '..')
export const ROOT = join(WEB, '..')
const VENV = process.env.STREAMGATE_VENV ?? join(ROOT, '.venv')

/** The tiny model's folder: `STREAMGATE_TINY_MODEL` (set once per run by test/run.ts), or built now. */
export function tinyModel(): string {
  const given = process.env.STREAMGATE_TINY_MODEL
  if (given && existsSync(join(given, 'config.json'))) return given
  const path = join(mkdtempSync(join(tmpdir(), 'streamgate-web-')), 'tiny-model')
  execFileSync(join(VENV, 'bin', 'python'), [join(WEB, 'test', 'support', 'tiny_model.py'), path], {stdio: 'ignore'})
  process.env.STREAMGATE_TINY_MODEL = path
  return path
}

/**
 * A tiny random model of another kind (tests/support/tiny_models.py: `esm_mlm`, `bert_mlm`, …; `llama`:
 * the tiny Llama's shape) built at `path`, its weights drawn with `seed`.
 */
export function buildModel(kind: string, path: string, seed = 0): string {
  execFileSync(join(VENV, 'bin', 'python'), [join(WEB, 'test', 'support', 'tiny_model.py'), path, kind, String(seed)], {stdio: ['ignore', 'ignore', 'pipe']})
  return path
}

/** ChatML, as SmolLM2 and Qwen write it: for a copy of the tiny model that must have a chat template. */
const CHATML =
  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}" +
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"

/**
 * A copy of the tiny model at `path` whose tokenizer has a chat template (`chat`: its own, or
 * ChatML where it has none) or has none (the gateway then refuses `messages`).
 */
export function tinyModelCopy(path: string, chat: boolean): string {
  cpSync(tinyModel(), path, {recursive: true})
  const jinja = join(path, 'chat_template.jinja')
  const configPath = join(path, 'tokenizer_config.json')
  const config = JSON.parse(readFileSync(configPath, 'utf8')) as {chat_template?: unknown}
  if (chat) {
    if (!existsSync(jinja) && !config.chat_template) writeFileSync(jinja, CHATML)
  } else {
    rmSync(jinja, {force: true})
    delete config.chat_template
    writeFileSync(configPath, JSON.stringify(config, null, 2))
  }
  return path
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer()
    server.once('error', reject)
    server.listen(0, '127.0.0.1', () => {
      const address = server.address()
      const port = typeof address === 'object' && address ? address.port : 0
      server.close(() => resolve(port))
    })
  })
}

export interface Gateway {
  url: string
  output: () => string
  stop: () => Promise<void>
}

/**
 * `streamgate serve` on `model` (the tiny Llama unless given; several, by name, as `{base: path, other: path}`,
 * the first the default), with `args` after the defaults and `env` added to its environment.
 */
export async function startGateway(
  args: string[] = [],
  model: string | Record<string, string> = tinyModel(),
  env: Record<string, string> = {},
): Promise<Gateway> {
  const port = await freePort()
  const url = `http://127.0.0.1:${port}`
  const models = typeof model === 'string' ? ['--model', model] : Object.entries(model).flatMap(([name, path]) => ['--model', `${name}=${path}`])
  const child: ChildProcess = spawn(
    join(VENV, 'bin', 'streamgate'),
    ['serve', ...models, '--device', 'cpu', '--host', '127.0.0.1', '--port', String(port), '--log-level', 'warning', ...args],
    {stdio: ['ignore', 'pipe', 'pipe'], env: {...process.env, PYTHONUNBUFFERED: '1', ...env}},
  )
  let output = ''
  child.stdout?.on('data', (b: Buffer) => (output += b.toString()))
  child.stderr?.on('data', (b: Buffer) => (output += b.toString()))
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  const stop = async () => {
    if (child.exitCode !== null || child.signalCode !== null) return
    child.kill('SIGTERM')
    const timer = setTimeout(() => child.kill('SIGKILL'), 10_000)
    await exited
    clearTimeout(timer)
  }
  const deadline = Date.now() + 90_000
  for (;;) {
    if (child.exitCode !== null) throw new Error(`the gateway exited (${child.exitCode}):\n${output}`)
    try {
      if ((await fetch(`${url}/readyz`)).ok) break
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      await stop()
      throw new Error(`the gateway was not ready in time:\n${output}`)
    }
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
  return {url, output: () => output, stop}
}

/**
 * `/mcp` driven by a client this project did not write: the MCP Inspector's CLI
 * (`@modelcontextprotocol/inspector --cli`), against a live gateway on the tiny model, on both
 * wire eras it speaks (the 2025 initialize handshake, its default for a URL, and 2026-07-28).
 * tools/list gives the tools' schemas as `GET /tools` does, tools/call answers what `POST
 * /{tool}/run` answers, a refusal is `isError` with the run's code, and without the gateway's
 * token nothing is served. The Inspector keeps its files under a HOME of the test's own.
 */
import assert from 'node:assert/strict'
import {execFile} from 'node:child_process'
import {mkdtempSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {startGateway, WEB, type Gateway} from './support/gateway.ts'

const TOKEN = 'inspector-token-0123456789'
const AUTH = {Authorization: `Bearer ${TOKEN}`}
const INSPECTOR = join(WEB, 'node_modules', '.bin', 'mcp-inspector')
const ERAS = ['legacy', 'modern'] as const

interface Outcome {
  code: number
  stdout: string
  stderr: string
}

let gateway: Gateway
let home: string

/** One Inspector CLI run against the gateway's `/mcp`: its exit code and what it printed. */
function inspector(args: string[], token: string | null = TOKEN): Promise<Outcome> {
  const auth = token === null ? ['--stored-auth-only'] : ['--header', `Authorization: Bearer ${token}`]
  const argv = ['--cli', `${gateway.url}/mcp`, '--format', 'json', ...auth, ...args]
  const env = {...process.env, HOME: home, MCP_CATALOG_PATH: join(home, 'mcp.json'), MCP_AUTO_OPEN_ENABLED: 'false'}
  return new Promise((resolve) => {
    execFile(INSPECTOR, argv, {env, timeout: 120_000}, (error, stdout, stderr) => {
      const code = error === null ? 0 : typeof error.code === 'number' ? error.code : -1
      resolve({code, stdout, stderr})
    })
  })
}

function parsed(text: string): any {
  assert.ok(text.trim(), 'the Inspector printed nothing')
  return JSON.parse(text)
}

/** A run's terminal `data` event, as `POST /{tool}/run` streams it. */
async function run(tool: string, params: unknown): Promise<unknown> {
  const response = await fetch(`${gateway.url}/${tool}/run`, {
    method: 'POST',
    headers: {...AUTH, 'Content-Type': 'application/json'},
    body: JSON.stringify(params),
  })
  assert.equal(response.status, 200)
  const blocks = (await response.text()).split('\n\n')
  const data = blocks.find((block) => block.includes('event: data\n'))
  assert.ok(data, 'the run ended without a data event')
  return JSON.parse(data.split('\n').find((line) => line.startsWith('data: '))!.slice('data: '.length))
}

describe('the MCP Inspector against /mcp', () => {
  before(async () => {
    home = mkdtempSync(join(tmpdir(), 'streamgate-inspector-'))
    gateway = await startGateway(['--tokens', `inspector=${TOKEN}`])
  })

  after(async () => {
    await gateway?.stop()
    rmSync(home, {recursive: true, force: true})
  })

  for (const era of ERAS) {
    test(`${era}: tools/list gives each tool the schemas GET /tools gives`, async () => {
      const listed = await inspector(['--protocol-era', era, '--method', 'tools/list'])
      assert.equal(listed.code, 0, listed.stderr)
      const tools: any[] = parsed(listed.stdout).result.tools
      const described: any[] = await (await fetch(`${gateway.url}/tools`)).json()
      const runnable = described.filter((d) => d.unsupported === null)
      assert.deepEqual(tools.map((t) => t.name).sort(), runnable.map((d) => d.name).sort())
      for (const d of runnable) {
        const tool = tools.find((t) => t.name === d.name)
        const {model: _model, ...properties} = d.params_schema.properties
        assert.deepEqual(tool.inputSchema, {...d.params_schema, properties})
        assert.deepEqual(tool.outputSchema, d.result_schema)
      }
    })

    test(`${era}: tools/call answers what the same run answers`, async () => {
      const params = {prompts: ['Hello', 'The quick'], max_tokens: 5}
      const called = await inspector(['--protocol-era', era, '--method', 'tools/call', '--tool-name', 'generate', '--tool-args-json', JSON.stringify(params)])
      assert.equal(called.code, 0, called.stderr)
      const result = parsed(called.stdout).result
      assert.equal(result.isError, false)
      assert.deepEqual(result.structuredContent, await run('generate', params))
      assert.deepEqual(JSON.parse(result.content[0].text), result.structuredContent)
      const job = await (await fetch(`${gateway.url}/jobs/${result._meta['streamgate/job_id']}`, {headers: AUTH})).json()
      assert.equal(job.status, 'SUCCEEDED')
    })

    test(`${era}: a refusal is isError with the run's code`, async () => {
      const called = await inspector(['--protocol-era', era, '--method', 'tools/call', '--tool-name', 'generate', '--tool-args-json', '{"prompts":["Hello"],"max_tokens":0}'])
      assert.notEqual(called.code, 0)
      const result = parsed(called.stdout).result
      assert.equal(result.isError, true)
      assert.equal(result._meta['streamgate/error'].code, 'invalid_params')
      assert.equal(result._meta['streamgate/error'].field, 'max_tokens')
    })
  }

  test('without the token, nothing is served', async () => {
    const refused = await inspector(['--method', 'tools/list'], null)
    assert.notEqual(refused.code, 0)
    assert.equal(refused.stdout.trim(), '')
    assert.match(refused.stderr, /unauthorized/)
  })
})

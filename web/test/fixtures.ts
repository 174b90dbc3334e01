/**
 * Event streams as the gateway writes them (and as it may be proxied: CRLF, CR, a BOM),
 * each with what a client must make of it.
 */

export interface Expected {
  /** The `data` payload runAndStream resolves with, or the `error` it rejects with. */
  result?: unknown
  error?: {code: string; message: string; retryable: boolean}
  /** `status` of each onStatus call, in order. */
  statuses: string[]
  /** `message` of each onLog call, and the status reported at that moment. */
  logs: {message: string; status: string | undefined}[]
  partials: unknown[]
}

export interface Fixture {
  name: string
  stream: string
  expected: Expected
}

const JOB = '8c701540290148f7b17d07ca3626476e'
const status = (seq: number, body: string) =>
  `id: ${JOB}:${seq}\nevent: status\ndata: {"job_id":"${JOB}","seq":${seq},${body}}\n\n`
const log = (seq: number, level: string, message: string) =>
  `id: ${JOB}:${seq}\nevent: log\ndata: {"job_id":"${JOB}","seq":${seq},"ts":1795267923.8,"level":"${level}","message":${JSON.stringify(message)}}\n\n`
const event = (seq: number, type: string, data: string) => `id: ${JOB}:${seq}\nevent: ${type}\ndata: ${data}\n\n`

const START =
  'retry: 3000\n\n' +
  status(1, '"status":"RECEIVED","ts":1795267923.709') +
  status(2, '"status":"QUEUED","ts":1795267923.709,"position":1,"queue_size":1') +
  status(3, '"status":"RUNNING","ts":1795267923.72')

const RESULT = {
  completions: [' Paris → Île-de-France 🗼'],
  usage: {prompt_tokens: 5, completion_tokens: 3, total_tokens: 8},
  finish_reasons: ['length'],
}

export const GENERATE: Fixture = {
  name: 'generate: statuses, partials with multi-byte text, a log, the result',
  stream:
    START +
    event(4, 'partial', '{"index":0,"text":" Paris","token_ids":[7042]}') +
    status(5, '"status":"RUNNING","ts":1795267923.846,"progress":{"done":1,"total":3,"unit":"tokens"}') +
    log(6, 'info', 'sampling… ünïcödé') +
    event(7, 'partial', '{"index":0,"text":" → Île-de-France","token_ids":[1,2]}') +
    event(8, 'partial', '{"index":0,"text":" 🗼","token_ids":[3]}') +
    status(9, '"status":"RUNNING","ts":1795267924.253,"progress":{"done":3,"total":3,"unit":"tokens"}') +
    event(10, 'data', JSON.stringify(RESULT)),
  expected: {
    result: RESULT,
    statuses: ['RECEIVED', 'QUEUED', 'RUNNING', 'RUNNING', 'RUNNING'],
    logs: [{message: 'sampling… ünïcödé', status: 'RUNNING'}],
    partials: [
      {index: 0, text: ' Paris', token_ids: [7042]},
      {index: 0, text: ' → Île-de-France', token_ids: [1, 2]},
      {index: 0, text: ' 🗼', token_ids: [3]},
    ],
  },
}

export const ERROR: Fixture = {
  name: 'a tool error after logs: the error event ends the job',
  stream:
    START +
    log(4, 'warning', 'about to fail') +
    event(5, 'error', `{"job_id":"${JOB}","seq":5,"error":{"code":"tool_error","message":"ValueError: nope","retryable":false}}`),
  expected: {
    error: {code: 'tool_error', message: 'ValueError: nope', retryable: false},
    statuses: ['RECEIVED', 'QUEUED', 'RUNNING'],
    logs: [{message: 'about to fail', status: 'RUNNING'}],
    partials: [],
  },
}

export const LOG_WHILE_QUEUED: Fixture = {
  name: 'logs while queued and while running never change the status',
  stream:
    'retry: 3000\n\n' +
    status(1, '"status":"RECEIVED","ts":1') +
    status(2, '"status":"QUEUED","ts":1,"position":2,"queue_size":2') +
    log(3, 'info', 'RUNNING') + // a log whose text looks like a status
    status(4, '"status":"QUEUED","ts":2,"position":1,"queue_size":1') +
    log(5, 'error', 'still queued') +
    status(6, '"status":"RUNNING","ts":3') +
    log(7, 'info', 'QUEUED') +
    event(8, 'data', '{"predictions":[]}'),
  expected: {
    result: {predictions: []},
    statuses: ['RECEIVED', 'QUEUED', 'QUEUED', 'RUNNING'],
    logs: [
      {message: 'RUNNING', status: 'QUEUED'},
      {message: 'still queued', status: 'QUEUED'},
      {message: 'QUEUED', status: 'RUNNING'},
    ],
    partials: [],
  },
}

export const MULTILINE: Fixture = {
  name: 'data over several data: lines is joined with newlines',
  stream:
    START +
    `id: ${JOB}:4\nevent: data\ndata: {\ndata:   "ll": [-1.5, -2.25],\ndata:   "is_greedy": [true, false]\ndata: }\n\n`,
  expected: {
    result: {ll: [-1.5, -2.25], is_greedy: [true, false]},
    statuses: ['RECEIVED', 'QUEUED', 'RUNNING'],
    logs: [],
    partials: [],
  },
}

export const NOISE: Fixture = {
  name: 'heartbeats, comments, unknown events, id-only blocks and bare messages are ignored',
  stream:
    ': hello\n\n' +
    'retry: 1000\n\n' +
    status(1, '"status":"RECEIVED","ts":1') +
    ': ping\n\n' +
    ': ping\n\n' +
    event(2, 'progress-v2', '{"whatever":true}') +
    'data: a bare message with no event type\n\n' +
    `id: ${JOB}:3\n\n` +
    'event: status\n\n' + // no data: no event dispatched
    status(3, '"status":"RUNNING","ts":2') +
    ': ping\n\n' +
    'event: partial\ndata:{"no_space_after_colon":true}\nid: x\n\n' +
    'unknown-field: value\n\n' +
    event(5, 'data', '{"ok":1}') +
    ': ping\n\n',
  expected: {
    result: {ok: 1},
    statuses: ['RECEIVED', 'RUNNING'],
    logs: [],
    partials: [{no_space_after_colon: true}],
  },
}

export const AFTER_TERMINAL: Fixture = {
  name: 'nothing after the terminal event counts',
  stream:
    START +
    event(4, 'data', '{"first":true}') +
    event(5, 'data', '{"first":false}') +
    log(6, 'info', 'late') +
    event(7, 'error', '{"error":{"code":"internal","message":"late","retryable":false}}'),
  expected: {result: {first: true}, statuses: ['RECEIVED', 'QUEUED', 'RUNNING'], logs: [], partials: []},
}

export const FIXTURES: Fixture[] = [GENERATE, ERROR, LOG_WHILE_QUEUED, MULTILINE, NOISE, AFTER_TERMINAL]

/** The same stream as a proxy or another server might frame it. */
export const VARIANTS: {name: string; transform: (s: string) => string}[] = [
  {name: 'LF', transform: (s) => s},
  {name: 'CRLF', transform: (s) => s.replaceAll('\n', '\r\n')},
  {name: 'CR', transform: (s) => s.replaceAll('\n', '\r')},
  {name: 'BOM + LF', transform: (s) => '\uFEFF' + s},
  {name: 'BOM + CRLF', transform: (s) => '\uFEFF' + s.replaceAll('\n', '\r\n')},
]

/** Streams that end without a terminal event. */
export const TRUNCATED: {name: string; stream: string}[] = [
  {name: 'no terminal event', stream: START},
  {name: 'the data event without its blank line', stream: START + event(4, 'data', '{"x":1}').slice(0, -1)},
  {name: 'the data event cut mid-line', stream: START + event(4, 'data', '{"x":1}').slice(0, -6)},
  {name: 'an empty body', stream: ''},
]

export {JOB}

/**
 * One job on the page: the browser's own `EventSource` on `GET /{tool}/run?params=…`,
 * read by the package's `JobTracker`, drawn as it happens.
 *
 * The EventSource is closed after the terminal event, so the browser never opens
 * the URL again. A connection lost before then is left to the browser: it
 * reconnects with `Last-Event-ID`, and the gateway resumes the same job from the
 * next event. `EventSource` cannot read a refused request's body, so when the
 * stream fails to open the same URL is fetched once to show the gateway's error
 * (its 422 names the field); should that fetch be accepted after all, it is
 * cancelled at once. Cancel sends `DELETE /jobs/{id}` and shows the job's own
 * `cancelled` event.
 *
 * On a gateway with tokens (`login.ts`) each EventSource carries a ticket of its
 * own, and a 401 waits for the token field before trying again. A ticket expires
 * within a minute: the browser's reconnect after that is refused (401) and closes
 * the EventSource for good, so the job is picked up again with a fresh ticket on
 * `GET /jobs/{id}/events?last_event_id=…`, from the event after the last one seen.
 *
 * A finished job's card links its result as a file (`GET /jobs/{id}/result`), and each file the
 * result names (`GET /jobs/{id}/files/{name}`), each link with a ticket of its own on a gateway with tokens.
 */
import {HttpError, ProtocolError} from '../errors.ts'
import type {ErrorInfo, GeneratePartial, ResultFile, ToolInfo} from '../generated/types.ts'
import {JobTracker, type JobEvent} from '../job.ts'
import {bytes, fmt, h} from './dom.ts'
import {stringifyExact} from './exact.ts'
import {fileList, resultFiles} from './files.ts'
import type {Login} from './login.ts'
import {mounted, renderResult, streamHeader} from './views.ts'

/** How a job ended, when not with its result: as its card shows it. */
export interface Failure {
  code: string
  message: string
  field?: string | null | undefined
  status?: number | undefined
}

export interface JobHooks {
  /** The gateway refused the params: show `message` on `field` in the form. */
  onRefused: (field: string | undefined, message: string) => void
  /** Each `partial` event's payload, as it comes. */
  onPartial?: (partial: unknown) => void
  /** The result. */
  onDone?: (result: unknown) => void
  /** The job ended without a result (refused, failed, cancelled, lost): the error its card shows. */
  onFailed?: (failure: Failure) => void
}

type Outcome = 'running' | 'done' | 'error' | 'cancelled'
const EVENT_TYPES = ['status', 'log', 'partial', 'data', 'error'] as const

/** Streams resumed in a row, with no event between them, before the job is given up as lost. */
const MAX_RESUMES = 5

export function startJob(base: URL, login: Login, tool: ToolInfo, params: Record<string, unknown>, hooks: JobHooks): HTMLElement {
  const url = runUrl(base, tool, params)
  const tracker = new JobTracker()
  const started = performance.now()
  let source: EventSource | undefined
  let reconnecting = false
  let resumes = 0

  // -- the card ------------------------------------------------------------
  const badge = h('span', {class: 'badge'}, 'starting')
  const elapsed = h('span', {class: 'muted elapsed'})
  const jobId = h('code', {class: 'job-id', title: 'job id'})
  const cancel = h('button', {type: 'button', class: 'secondary', onclick: () => void stop()}, 'Cancel')
  const download = h('span', {class: 'download'})
  const files = h('div', {class: 'result-files', hidden: true})
  const remove = h('button', {type: 'button', class: 'icon', title: 'Remove', 'aria-label': 'Remove', hidden: true, onclick: () => card.remove()}, '×')
  const timeline = h('ol', {class: 'timeline'})
  const queue = h('div', {class: 'queue muted', hidden: true})
  const bar = h('div', {class: 'progress-bar'})
  const progressText = h('span', {class: 'progress-text muted'})
  const progress = h('div', {class: 'progress', hidden: true}, h('div', {class: 'progress-track'}, bar), progressText)
  const logs = h('ol', {class: 'logs'})
  const logBox = h('details', {class: 'log-box', hidden: true, open: true}, h('summary', {}, 'Logs'), logs)
  const tokens = h('div', {class: 'tokens', hidden: true}, streamHeader(tool.name, params))
  const partialBox = h('pre', {class: 'partials json', hidden: true})
  const result = h('div', {class: 'result', hidden: true})
  const errorBox = h('div', {class: 'error', role: 'alert', hidden: true})
  const raw = h('pre', {class: 'json'})
  const rawBox = h('details', {class: 'raw', hidden: true}, h('summary', {}, 'JSON'), raw)
  const request = h('details', {class: 'request'}, h('summary', {}, 'Request'), h('pre', {class: 'json'}, `GET ${url.pathname}\n${stringifyExact(params, 2)}`))
  const card = h(
    'article',
    {class: 'job', 'data-tool': tool.name, 'data-state': 'running'},
    h(
      'header',
      {},
      h('strong', {}, tool.name),
      // Named only where the page picks among several models.
      typeof params.model === 'string' ? h('span', {class: 'job-model muted', title: 'model'}, params.model) : null,
      jobId,
      badge,
      elapsed,
      h('span', {class: 'spacer'}),
      download,
      cancel,
      remove,
      files,
    ),
    timeline,
    queue,
    progress,
    tokens,
    partialBox,
    errorBox,
    result,
    logBox,
    rawBox,
    request,
  )
  const ticker = setInterval(() => (elapsed.textContent = seconds(performance.now() - started)), 250)

  let failure: Failure | undefined
  const finish = (outcome: Outcome) => {
    if (card.dataset.state !== 'running') return
    source?.close()
    clearInterval(ticker)
    elapsed.textContent = seconds(performance.now() - started)
    card.dataset.state = outcome
    badge.textContent = outcome === 'done' ? 'done' : outcome === 'cancelled' ? 'cancelled' : 'error'
    badge.className = `badge ${outcome}`
    queue.hidden = true
    cancel.hidden = true
    remove.hidden = false
    if (outcome !== 'done') hooks.onFailed?.(failure ?? {code: outcome, message: `the job ended ${outcome}`})
  }
  const showError = (error: {code: ErrorInfo['code'] | 'protocol' | 'stream_ended' | 'http_error' | 'unreachable'; message: string; field?: string | null | undefined}, status?: number) => {
    failure = {code: error.code, message: error.message, field: error.field, status}
    errorBox.replaceChildren(
      h('span', {class: 'code'}, status ? `${status} ${error.code}` : error.code),
      ' ',
      h('span', {class: 'message'}, error.message),
    )
    errorBox.hidden = false
  }
  const step = (label: string, detail: string, kind: string) =>
    timeline.appendChild(h('li', {'data-status': label, class: kind}, h('span', {class: 'step'}, label), detail ? ` ${detail}` : '', h('span', {class: 'muted when'}, seconds(performance.now() - started))))

  // -- events ----------------------------------------------------------------
  const onEvent = (event: JobEvent) => {
    const state = tracker.state
    jobId.textContent = state.jobId?.slice(0, 8) ?? ''
    jobId.title = state.jobId ?? ''
    switch (event.type) {
      case 'status': {
        const frame = event.frame
        if (state.timeline.at(-1) === frame) {
          const where = frame.status === 'QUEUED' && frame.position ? `#${frame.position}${frame.queue_size ? ` of ${frame.queue_size}` : ''}` : ''
          step(frame.status, where, 'status')
        }
        badge.textContent = frame.status.toLowerCase()
        queue.hidden = frame.status !== 'QUEUED'
        if (frame.status === 'QUEUED') {
          const why = frame.message ? ` (${frame.message})` : ''
          queue.textContent = `Queued: position ${frame.position ?? '?'}${frame.queue_size ? ` of ${frame.queue_size}` : ''}${frame.eta_s ? `, about ${fmt(frame.eta_s, 1)} s to go` : ''}${why}`
        }
        if (frame.progress) {
          const {done, total, unit} = frame.progress
          progress.hidden = false
          bar.style.width = total ? `${Math.min(100, (100 * done) / total)}%` : '100%'
          bar.classList.toggle('indeterminate', !total)
          progressText.textContent = `${done}${total ? ` / ${total}` : ''}${unit ? ` ${unit}` : ''}`
        }
        if (frame.message) step(frame.status, frame.message, 'message')
        break
      }
      case 'log':
        logBox.hidden = false
        logs.appendChild(h('li', {class: `log-${event.frame.level}`}, h('span', {class: 'level'}, event.frame.level), ' ', event.frame.message))
        break
      case 'partial':
        showPartial(event.partial)
        hooks.onPartial?.(event.partial)
        break
      case 'data':
        step('done', '', 'done')
        if (state.progress?.total) bar.style.width = '100%'
        {
          // How long the result takes to show, from its arrival (parsed) to its view built, laid
          // out and its canvases drawn: on the card (data-render-ms) and in the browser's
          // performance timeline.
          const drawing = performance.now()
          const id = state.jobId
          const fileLink = id ? (file: ResultFile) => fileAnchor(base, login, id, file) : undefined
          const view = renderResult(tool.name, event.result, params, fileLink)
          result.replaceChildren(view)
          result.hidden = false
          tokens.hidden = true
          partialBox.hidden = true
          mounted(view)
          const ms = performance.now() - drawing
          result.dataset.renderMs = ms.toFixed(2)
          try {
            performance.measure(`streamgate: ${tool.name} result drawn`, {start: drawing, duration: ms})
          } catch {
            // A browser without User Timing's measure options: the card's attribute is enough.
          }
        }
        raw.textContent = JSON.stringify(event.result, null, 2)
        rawBox.hidden = false
        if (state.jobId) {
          const id = state.jobId
          download.replaceChildren(resultLink(base, login, id))
          const listed = resultFiles(event.result)
          if (listed.length) {
            files.replaceChildren(h('span', {class: 'muted'}, 'Files:'), fileList(listed, (file) => fileAnchor(base, login, id, file)))
            files.hidden = false
          }
        }
        finish('done')
        hooks.onDone?.(event.result)
        break
      case 'error':
        step('error', event.error.code, 'failed')
        showError(event.error)
        finish(event.error.code === 'cancelled' ? 'cancelled' : 'error')
        break
    }
  }

  const streams = new Map<number, HTMLElement>()
  const showPartial = (partial: unknown) => {
    const p = partial as Partial<GeneratePartial>
    if (typeof p.text === 'string' && typeof p.index === 'number') {
      let out = streams.get(p.index)
      if (!out) {
        const prompt = Array.isArray(params.prompts) ? String(params.prompts[p.index] ?? '') : ''
        out = h('span', {class: 'completion-text'})
        streams.set(p.index, out)
        tokens.appendChild(h('p', {class: 'completion streaming', 'data-index': p.index}, h('span', {class: 'prompt'}, prompt), out))
        tokens.hidden = false
      }
      out.appendChild(h('span', {class: 'token', title: (p.token_ids ?? []).join(' ')}, p.text))
      return
    }
    partialBox.hidden = false
    partialBox.textContent = `partial #${tracker.state.partials}: ${JSON.stringify(partial)}`
  }

  const handle = (message: MessageEvent<string>) => {
    resumes = 0
    try {
      const event = tracker.observe({event: message.type, data: message.data, id: message.lastEventId})
      if (event) onEvent(event)
    } catch (error) {
      if (!(error instanceof ProtocolError)) throw error
      showError({code: 'protocol', message: error.message})
      finish('error')
    }
  }

  // -- the stream ------------------------------------------------------------
  /** Open an EventSource: on the run URL to start the job, or on its events after the last one seen to resume it. */
  const connect = async (resume: boolean) => {
    let ticket: string | undefined
    try {
      ticket = await login.ticket()
    } catch (error) {
      const e = error instanceof HttpError ? error : undefined
      showError(e ? {code: e.code ?? 'http_error', message: e.message} : {code: 'unreachable', message: `the gateway cannot be reached: ${(error as Error).message}`}, e?.status)
      step('refused', '', 'failed')
      finish('error')
      return
    }
    if (card.dataset.state !== 'running') return // cancelled while waiting for a ticket or a token
    const target = resume ? eventsUrl(base, tracker.state.jobId!, tracker.state.lastEventId) : url
    const streamUrl = new URL(target)
    if (ticket) streamUrl.searchParams.set('ticket', ticket)
    const es = new EventSource(streamUrl)
    source = es
    let opened = false
    for (const type of EVENT_TYPES) {
      es.addEventListener(type, (event) => {
        if (es !== source) return
        // The `error` event type is also how EventSource reports a failed connection (a plain Event).
        if (event instanceof MessageEvent && typeof event.data === 'string') handle(event as MessageEvent<string>)
        else if (type === 'error') void connectionFailed(es, opened, ticket !== undefined, target, resume)
      })
    }
    es.addEventListener('open', () => {
      if (es !== source) return
      if (reconnecting) step('resumed', '', 'status')
      reconnecting = false
      opened = true
      badge.textContent = tracker.state.status?.toLowerCase() ?? 'open'
    })
  }

  const connectionFailed = async (es: EventSource, opened: boolean, ticketed: boolean, target: URL, resume: boolean) => {
    if (tracker.state.done || card.dataset.state !== 'running') return
    const lost = () => {
      if (!reconnecting) step('reconnecting', '', 'failed')
      reconnecting = true
      badge.textContent = 'reconnecting'
    }
    if (es.readyState === EventSource.CONNECTING) {
      // The browser tries again by itself, with Last-Event-ID: the gateway resumes this job.
      lost()
      return
    }
    es.close()
    if (opened) {
      // The browser's own reconnect was refused. With a ticket, most likely because it expired
      // (401): resume from the last event seen, with a fresh ticket.
      if (ticketed && tracker.state.jobId && resumes++ < MAX_RESUMES) {
        lost()
        await connect(true)
        return
      }
      step('lost', '', 'failed')
      showError({code: 'stream_ended', message: 'the connection was lost and the job could not be resumed'})
      finish('error')
      return
    }
    // The stream never opened: ask again with fetch to read the gateway's answer.
    const probe = new AbortController()
    const token = login.token
    try {
      const response = await fetch(target, {signal: probe.signal, headers: {Accept: 'application/json', ...login.headers()}})
      if (response.status === 401) {
        // This gateway needs a token (or refused ours): wait for one, then try again.
        const error = await HttpError.fromResponse(response)
        showError({code: error.code ?? 'http_error', message: error.message}, error.status)
        if (!timeline.querySelector('[data-status=unauthorized]')) step('unauthorized', 'waiting for a token', 'failed')
        badge.textContent = 'needs a token'
        await login.refused(token)
        if (card.dataset.state !== 'running') return
        errorBox.hidden = true
        await connect(resume)
        return
      }
      if (response.ok) {
        probe.abort()
        // A resume accepted this time (its ticket had run out on the way): open it again.
        if (resume && resumes++ < MAX_RESUMES) {
          await connect(true)
          return
        }
        // Accepted this time after all: cancel the job this request started.
        const id = response.headers.get('X-Job-Id')
        if (id && !resume) void fetch(new URL(`jobs/${encodeURIComponent(id)}`, base), {method: 'DELETE', headers: login.headers()}).catch(() => undefined)
        showError({code: 'stream_ended', message: 'the event stream could not be opened'})
      } else {
        const error = await HttpError.fromResponse(response)
        showError({code: error.code ?? 'http_error', message: error.message, field: error.field}, error.status)
        if (!resume && (error.status === 422 || error.status === 413 || error.status === 400)) hooks.onRefused(error.field, error.message)
      }
    } catch (error) {
      showError({code: 'unreachable', message: `the gateway cannot be reached: ${(error as Error).message}`})
    }
    step('refused', '', 'failed')
    finish('error')
  }

  const closeHere = (message: string) => {
    if (card.dataset.state !== 'running') return
    source?.close()
    step('cancelled', 'by you', 'failed')
    showError({code: 'cancelled', message})
    finish('cancelled')
  }
  const stop = async () => {
    if (card.dataset.state !== 'running') return
    cancel.disabled = true
    badge.textContent = 'cancelling'
    const id = tracker.state.jobId
    let deleted = false
    if (id) {
      try {
        deleted = (await fetch(new URL(`jobs/${encodeURIComponent(id)}`, base), {method: 'DELETE', headers: login.headers()})).ok
      } catch {
        // The gateway cannot be reached: all there is left to do is stop listening.
      }
    }
    if (deleted) {
      // The job's own `cancelled` event ends the stream; stop waiting for it after a while.
      setTimeout(() => closeHere('cancelled; the gateway did not confirm it'), 5000)
    } else {
      closeHere('you stopped following the job')
    }
  }

  void connect(false)
  return card
}

/** A link to `GET /jobs/{id}/result`: the result alone, as a file. */
function resultLink(base: URL, login: Login, jobId: string): HTMLAnchorElement {
  const plain = new URL(`jobs/${encodeURIComponent(jobId)}/result`, base)
  return ticketed(h('a', {class: 'download-result', href: plain.href, download: `${jobId}.json`}, 'Download result'), plain, login)
}

/**
 * A link to `GET /jobs/{id}/files/{name}`, one of the files the job wrote beside its result; saved
 * as the gateway names it (`<id>.<name>`), so that the files of several jobs do not overwrite each other.
 */
function fileAnchor(base: URL, login: Login, jobId: string, file: ResultFile): HTMLAnchorElement {
  const plain = new URL(`jobs/${encodeURIComponent(jobId)}/files/${encodeURIComponent(file.name)}`, base)
  const title = `${file.description ? `${file.description}\n` : ''}${file.format}, ${bytes(file.size)}`
  const link = h('a', {class: 'download-file', href: plain.href, download: `${jobId}.${file.name}`, title, 'data-file': file.name}, file.name)
  return ticketed(link, plain, login)
}

/**
 * `link` to `plain`, with a ticket on a gateway with tokens: got when the link is pointed at, focused
 * or followed rather than with the result, as a ticket lives a minute at most and the link may be
 * followed long after. A click waits for a fresh one, then follows the link itself.
 */
function ticketed(link: HTMLAnchorElement, plain: URL, login: Login): HTMLAnchorElement {
  let arming: Promise<void> | undefined
  let followed = false
  const arm = (): Promise<void> => {
    arming ??= login
      .ticket()
      .then(
        (ticket) => {
          const url = new URL(plain)
          if (ticket) url.searchParams.set('ticket', ticket)
          link.href = url.href
        },
        () => undefined, // the gateway cannot be reached: following the link shows why
      )
      .finally(() => (arming = undefined))
    return arming
  }
  const prepare = () => void (login.token && arm())
  link.addEventListener('pointerenter', prepare)
  link.addEventListener('focus', prepare)
  link.addEventListener('click', (event) => {
    if (followed || !login.token) {
      followed = false
      return
    }
    event.preventDefault()
    void arm().then(() => {
      followed = true
      link.click()
    })
  })
  return link
}

/** `GET /jobs/{id}/events`, after `lastEventId` when there is one. */
function eventsUrl(base: URL, jobId: string, lastEventId: string | undefined): URL {
  const url = new URL(`jobs/${encodeURIComponent(jobId)}/events`, base)
  if (lastEventId) url.searchParams.set('last_event_id', lastEventId)
  return url
}

/** `GET /{tool}/run?params=<JSON>`; flat keys (a list's items repeated) for a tool that has a field called `params`. */
export function runUrl(base: URL, tool: ToolInfo, params: Record<string, unknown>): URL {
  const url = new URL(`${encodeURIComponent(tool.name)}/run`, base)
  const properties = (tool.params_schema as {properties?: Record<string, unknown>}).properties ?? {}
  if (!('params' in properties)) {
    url.searchParams.set('params', stringifyExact(params))
    return url
  }
  for (const [key, value] of Object.entries(params)) {
    for (const item of Array.isArray(value) ? value : [value]) {
      url.searchParams.append(key, typeof item === 'object' && item !== null ? stringifyExact(item) : String(item))
    }
  }
  return url
}

function seconds(ms: number): string {
  return `${(ms / 1000).toFixed(ms < 10_000 ? 2 : 1)} s`
}

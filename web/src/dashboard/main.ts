/** The dashboard: pick a tool, fill its generated form, run it, and watch each job stream. */
import {EXAMPLES, SAE_EXAMPLES} from '../examples.ts'
import type {ToolInfo} from '../generated/types.ts'
import {h} from './dom.ts'
import {buildForm, type ToolForm} from './form.ts'
import {startJob} from './jobs.ts'
import {Login} from './login.ts'
import './style.css'

const base = new URL('.', location.href)
const $ = <T extends HTMLElement>(selector: string) => document.querySelector(selector) as T

/** The model line at the top; `onReady` runs when a gateway that was not ready (its model loading) becomes ready. */
async function readiness(onReady: () => void, waited = false): Promise<void> {
  const line = $<HTMLElement>('#model')
  const again = (ms: number) => setTimeout(() => void readiness(onReady, true), ms)
  try {
    const response = await fetch(new URL('readyz', base))
    const body = (await response.json()) as {
      ready: boolean
      model?: string
      kind?: string
      capabilities?: string[]
      device?: string
      dtype?: string
      reason?: string
    }
    line.textContent = body.ready
      ? [body.model, body.kind, body.device, body.dtype].filter(Boolean).join(' · ')
      : `not ready: ${body.reason ?? ''}`
    line.title = body.capabilities?.length ? `capabilities: ${body.capabilities.join(', ')}` : ''
    line.classList.toggle('warn', !body.ready)
    if (!body.ready) again(2000)
    else if (waited) onReady()
  } catch {
    line.textContent = 'the gateway cannot be reached'
    line.classList.add('warn')
    again(5000)
  }
}

/** `GET /tools`, split: the tools the served model can run, and those it cannot (`unsupported` holds why). */
async function listTools(): Promise<{runnable: ToolInfo[]; unsupported: ToolInfo[]}> {
  const all = (await (await fetch(new URL('tools', base))).json()) as ToolInfo[]
  return {runnable: all.filter((t) => !t.unsupported), unsupported: all.filter((t) => t.unsupported)}
}

/** The tools the model cannot run, kept out of the picker: their names on one line, the gateway's reasons under it. */
function showUnsupported(box: HTMLDetailsElement, unsupported: ToolInfo[]): void {
  box.hidden = unsupported.length === 0
  box.replaceChildren(
    h('summary', {}, 'Not on this model: ', unsupported.map((t, i) => [i ? ', ' : '', h('code', {}, t.name)])),
    h('ul', {}, unsupported.map((t) => h('li', {'data-tool': t.name}, t.unsupported))),
  )
}

async function main(): Promise<void> {
  const picker = $<HTMLSelectElement>('#tool')
  const unsupportedBox = $<HTMLDetailsElement>('#unsupported')
  const description = $<HTMLElement>('#description')
  const formSlot = $<HTMLElement>('#form')
  const jobs = $<HTMLElement>('#jobs')
  const form = $<HTMLFormElement>('#run')
  const formError = $<HTMLElement>('#form-error')
  const login = new Login(base, $<HTMLFormElement>('#login'))

  let tools: ToolInfo[] = []
  const forms = new Map<string, ToolForm>()
  const current = (): ToolInfo | undefined => tools.find((t) => t.name === picker.value) ?? tools[0]
  const show = () => {
    const tool = current()
    form.querySelector<HTMLButtonElement>('button[type=submit]')!.disabled = !tool
    if (!tool) {
      description.textContent = 'The served model can run none of the tools.'
      formSlot.replaceChildren()
      return
    }
    let toolForm = forms.get(tool.name)
    if (!toolForm) {
      // The SAE tools' examples only matter when the gateway lists them (it serves an SAE).
      const examples = {...EXAMPLES, ...SAE_EXAMPLES} as unknown as Record<string, Record<string, unknown> | undefined>
      toolForm = buildForm(tool, examples[tool.name] ?? {})
      forms.set(tool.name, toolForm)
    }
    description.textContent = tool.description
    formSlot.replaceChildren(toolForm.element)
    formError.hidden = true
    if (location.hash.slice(1) !== tool.name) history.replaceState(null, '', `#${tool.name}`)
  }
  /** Fill the picker with the tools the model can run, keeping the chosen one (or the URL's) when it still is one. */
  const offer = ({runnable, unsupported}: Awaited<ReturnType<typeof listTools>>) => {
    const wanted = picker.value || decodeURIComponent(location.hash.slice(1))
    tools = runnable
    picker.replaceChildren(...tools.map((t) => h('option', {value: t.name}, t.name)))
    if (tools.some((t) => t.name === wanted)) picker.value = wanted
    showUnsupported(unsupportedBox, unsupported)
    show()
  }

  picker.addEventListener('change', show)

  form.addEventListener('submit', (event) => {
    event.preventDefault()
    const tool = current()
    if (!tool) return
    const toolForm = forms.get(tool.name)!
    toolForm.clearErrors()
    formError.hidden = true
    let params: Record<string, unknown>
    try {
      params = toolForm.read()
    } catch (error) {
      toolForm.showError(undefined, (error as Error).message)
      return
    }
    const card = startJob(base, login, tool, params, {
      onRefused: (field, message) => {
        if (current()?.name === tool.name) toolForm.showError(field, message)
      },
    })
    jobs.prepend(card)
    $<HTMLElement>('#empty').hidden = true
    // On a narrow screen the jobs are below the form: bring the new one into view.
    if (card.getBoundingClientRect().top > window.innerHeight) card.scrollIntoView({behavior: 'smooth', block: 'start'})
  })

  const list = () =>
    listTools().then(offer, (error: Error) => {
      formError.textContent = `could not list the tools: ${error.message}`
      formError.hidden = false
    })
  // While a local model loads, the gateway cannot yet say what it cannot run (nor while it cannot be
  // reached): list the tools again once it is ready.
  void readiness(() => void list())
  await list()
}

void main()

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

async function readiness(): Promise<void> {
  const line = $<HTMLElement>('#model')
  try {
    const response = await fetch(new URL('readyz', base))
    const body = (await response.json()) as {ready: boolean; model?: string; device?: string; dtype?: string; reason?: string}
    line.textContent = body.ready ? [body.model, body.device, body.dtype].filter(Boolean).join(' · ') : `not ready: ${body.reason ?? ''}`
    line.classList.toggle('warn', !body.ready)
    if (!body.ready) setTimeout(readiness, 2000)
  } catch {
    line.textContent = 'the gateway cannot be reached'
    line.classList.add('warn')
    setTimeout(readiness, 5000)
  }
}

async function main(): Promise<void> {
  void readiness()
  const picker = $<HTMLSelectElement>('#tool')
  const description = $<HTMLElement>('#description')
  const formSlot = $<HTMLElement>('#form')
  const jobs = $<HTMLElement>('#jobs')
  const form = $<HTMLFormElement>('#run')
  const formError = $<HTMLElement>('#form-error')
  const login = new Login(base, $<HTMLFormElement>('#login'))

  let tools: ToolInfo[]
  try {
    tools = (await (await fetch(new URL('tools', base))).json()) as ToolInfo[]
  } catch (error) {
    formError.textContent = `could not list the tools: ${(error as Error).message}`
    formError.hidden = false
    return
  }
  picker.replaceChildren(...tools.map((t) => h('option', {value: t.name}, t.name)))

  const forms = new Map<string, ToolForm>()
  const current = () => tools.find((t) => t.name === picker.value) ?? tools[0]!
  const show = () => {
    const tool = current()
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
  const wanted = decodeURIComponent(location.hash.slice(1))
  if (tools.some((t) => t.name === wanted)) picker.value = wanted
  picker.addEventListener('change', show)
  show()

  form.addEventListener('submit', (event) => {
    event.preventDefault()
    const tool = current()
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
        if (current().name === tool.name) toolForm.showError(field, message)
      },
    })
    jobs.prepend(card)
    $<HTMLElement>('#empty').hidden = true
    // On a narrow screen the jobs are below the form: bring the new one into view.
    if (card.getBoundingClientRect().top > window.innerHeight) card.scrollIntoView({behavior: 'smooth', block: 'start'})
  })
}

void main()

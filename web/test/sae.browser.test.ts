/**
 * The dashboard's SAE views in headless Chromium, against a gateway serving a tiny SAE
 * (test/support/tiny_sae.py): `sae_annotate` as feature chips under each token, `sae_features`
 * as a table, `sae_steer` streaming like `generate` under its clamps. Screenshots go to test-artifacts/.
 */
import assert from 'node:assert/strict'
import {execFileSync} from 'node:child_process'
import {mkdtempSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {type BrowserContext, type Page} from 'playwright-core'

import {runTool, SAE_EXAMPLES, type AnnotateResult, type GenerateResult} from '../src/index.ts'
import {ARTIFACTS, finished, launch, rawResult, run} from './support/browser.ts'
import {contrastRatio, luminance} from './support/contrast.ts'
import {ROOT, startGateway, tinyModel, WEB, type Gateway} from './support/gateway.ts'

const VENV = process.env.STREAMGATE_VENV ?? join(ROOT, '.venv')

let gateway: Gateway
let context: BrowserContext
let scratch: string

async function open(tool: string): Promise<Page & {errors: string[]}> {
  const page = (await context.newPage()) as Page & {errors: string[]}
  await page.setViewportSize({width: 1280, height: 900})
  page.errors = []
  page.on('pageerror', (error) => page.errors.push(error.message))
  page.on('console', (message) => message.type() === 'error' && page.errors.push(message.text()))
  await page.goto(`${gateway.url}/#${tool}`)
  await page.waitForSelector('#run[data-tools=gateway] #form [data-field]') // drawn from the gateway's /tools, not the copy kept from a visit before
  assert.equal(await page.locator('#tool').inputValue(), tool)
  return page
}


describe('the dashboard with an SAE', () => {
  before(async () => {
    scratch = mkdtempSync(join(tmpdir(), 'streamgate-sae-'))
    const sae = execFileSync(join(VENV, 'bin', 'python'), [join(WEB, 'test', 'support', 'tiny_sae.py'), tinyModel(), join(scratch, 'sae')], {
      encoding: 'utf8',
    }).trim()
    gateway = await startGateway(['--sae', sae, '--max-batch-size', '1'])
    context = await launch(join(scratch, 'profile'))
  })

  after(async () => {
    await context?.close()
    await gateway?.stop()
    if (scratch) rmSync(scratch, {recursive: true, force: true})
  })

  test('the SAE tools are listed, with their example params', async () => {
    const page = await open('sae_annotate')
    const names = await page.locator('#tool option').allInnerTexts()
    for (const name of Object.keys(SAE_EXAMPLES)) assert.ok(names.includes(name), `${name} not in ${names.join(', ')}`)
    assert.equal(await page.locator('[data-field=prompt] textarea').inputValue(), SAE_EXAMPLES.sae_annotate.prompt)
    await page.close()
  })

  test('sae_annotate (top): each token with its top features as chips, as the gateway answers', async () => {
    const page = await open('sae_annotate')
    const job = await run(page)
    await finished(job)
    const direct = await runTool(gateway.url, 'sae_annotate', SAE_EXAMPLES.sae_annotate)
    assert.deepEqual(await rawResult<AnnotateResult>(job), direct)
    const annotated = direct.tokens ?? assert.fail('a prompt is answered with `tokens`')
    const tokens = job.locator('.result .sae-token')
    assert.equal(await tokens.count(), annotated.length)
    assert.ok(annotated.some((t) => t.features.length > 0), 'no feature fired at all')
    for (const [i, token] of annotated.entries()) {
      const row = tokens.nth(i)
      const chips = row.locator('.sae-chip')
      assert.equal(await chips.count(), token.features.length, `token ${i}`)
      assert.ok(token.features.length <= (SAE_EXAMPLES.sae_annotate.k ?? 5))
      if (token.features.length) assert.equal(await chips.first().getAttribute('data-feature'), String(token.features[0]!.id), `token ${i}`)
      assert.equal(await row.locator('.sae-error span').count(), 1)
    }
    // A labelled feature shows its label on its chip.
    const labelled = annotated.flatMap((t) => t.features).find((f) => f.label)
    if (labelled) assert.ok((await job.locator(`.sae-chip[data-feature="${labelled.id}"] .sae-label`).first().innerText()) === labelled.label)
    await job.scrollIntoViewIfNeeded()
    await page.screenshot({path: join(ARTIFACTS, 'sae-annotate.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('sae_annotate (pick): the chosen features at every token, and a feature × position heatmap', async () => {
    const page = await open('sae_annotate')
    await page.selectOption('[data-field=mode] select', 'pick')
    await page.fill('[data-field=feature_ids] input', '0, 2, 5')
    const job = await run(page)
    await finished(job)
    const annotated = (await rawResult<AnnotateResult>(job)).tokens ?? assert.fail('a prompt is answered with `tokens`')
    const rows = job.locator('.result .sae-token')
    assert.equal(await rows.count(), annotated.length)
    for (let i = 0; i < annotated.length; i++) {
      const ids = await rows.nth(i).locator('.sae-chip').evaluateAll((chips) => chips.map((c) => c.getAttribute('data-feature')))
      assert.deepEqual(ids, ['0', '2', '5'])
    }
    assert.equal(await job.locator('.result svg.heatmap rect.cell').count(), 3 * annotated.length)
    await page.screenshot({path: join(ARTIFACTS, 'sae-annotate-pick.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('feature chips: their text contrasts with their colour at least 4.5:1 (WCAG AA), in light and dark mode', async () => {
    for (const colorScheme of ['light', 'dark'] as const) {
      const page = await open('sae_annotate')
      await page.emulateMedia({colorScheme})
      const chips: {background: string; colors: string[]; opacity: string; where: string}[] = []
      for (const [mode, ids] of [['top', ''], ['pick', '0, 2, 5, 9, 13']] as const) {
        await page.selectOption('[data-field=mode] select', mode)
        if (ids) await page.fill('[data-field=feature_ids] input', ids)
        const job = await run(page)
        await finished(job)
        const found = await job.locator('.result .sae-chip').evaluateAll((items) =>
          items.map((chip) => ({
            background: getComputedStyle(chip).backgroundColor,
            colors: [chip, ...chip.querySelectorAll('span')].map((e) => getComputedStyle(e).color),
            opacity: getComputedStyle(chip).opacity,
          })),
        )
        assert.ok(found.length > 0, `${mode}: no chip`)
        chips.push(...found.map((chip) => ({...chip, where: mode})))
      }
      for (const chip of chips) {
        assert.equal(chip.opacity, '1', `${colorScheme}, ${chip.where}: a chip faded, its text blended into the page`)
        for (const color of chip.colors) {
          const ratio = contrastRatio(chip.background, color)
          assert.ok(ratio >= 4.5, `${colorScheme}, ${chip.where}: ${color} on ${chip.background} is ${ratio.toFixed(2)}:1`)
        }
      }
      // The strongest activation's chip is the darkest colour.
      assert.ok(Math.min(...chips.map((chip) => luminance(chip.background))) < 0.05)
      assert.deepEqual(page.errors, [])
      await page.close()
    }
  })

  test('sae_features: a table of ids, labels and stats', async () => {
    const page = await open('sae_features')
    const job = await run(page)
    await finished(job)
    const rows = job.locator('.result table.sae-table tbody tr')
    assert.equal(await rows.count(), 16)
    assert.deepEqual(await rows.nth(1).locator('td').allInnerTexts().then((t) => t.slice(0, 2)), ['1', 'Hot dogs'])
    await page.screenshot({path: join(ARTIFACTS, 'sae-features.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('sae_steer: the clamps above the text, tokens streaming in, then the completion', async () => {
    const page = await open('sae_steer')
    await page.fill('[data-field=prompts] textarea', 'Once upon a time')
    await page.fill('[data-field=max_tokens] input', '48')
    // On the tiny model this clamp steers to one printable token; a stronger one yields bytes that
    // decode to text only at the end (stray UTF-8), which would not stream token by token.
    await page.fill('[data-field=clamps] textarea', '[{"feature_id": 3, "strength": 4}]')
    await page.evaluate(() => {
      const seen: {text: string; result: boolean; clamps: boolean}[] = []
      ;(window as unknown as {seen: typeof seen}).seen = seen
      new MutationObserver(() => {
        const job = document.querySelector('article.job')
        const text = job?.querySelector('.tokens .completion-text')?.textContent ?? ''
        if (text && text !== seen.at(-1)?.text) {
          seen.push({text, result: !job?.querySelector('.result')?.hasAttribute('hidden'), clamps: !!job?.querySelector('.tokens .sae-clamp')})
        }
      }).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true})
    })
    const job = await run(page)
    await finished(job)
    const seen = await page.evaluate(() => (window as unknown as {seen: {text: string; result: boolean; clamps: boolean}[]}).seen)
    const streamed = seen.filter((s) => !s.result)
    assert.ok(streamed.length >= 5, `the text grew only ${streamed.length} times before the result`)
    assert.ok(streamed.every((s) => s.clamps), 'the clamps were not shown above the streaming text')
    for (let i = 1; i < streamed.length; i++) assert.ok(streamed[i]!.text.startsWith(streamed[i - 1]!.text))
    const result = await rawResult<GenerateResult>(job)
    assert.equal(streamed.at(-1)!.text, result.completions[0])
    assert.equal(await job.locator('.result .completion-text').textContent(), result.completions[0])
    const clamps = await job.locator('.result .sae-clamp').allInnerTexts()
    assert.deepEqual(clamps, ['#3 → 4'])
    await page.screenshot({path: join(ARTIFACTS, 'sae-steer.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })
})

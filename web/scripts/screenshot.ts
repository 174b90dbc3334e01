/**
 * A screenshot of the dashboard for the docs, against a running gateway (the default model
 * makes the best picture): `npm run screenshot -- [URL] [PNG]`, by default
 * http://127.0.0.1:8000 and ../docs/dashboard.png. Uses Debian's Chromium, like the tests.
 */
import {mkdtempSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join, resolve} from 'node:path'
import {chromium, type Page} from 'playwright-core'

const [url = 'http://127.0.0.1:8000', out = resolve('..', 'docs', 'dashboard.png')] = process.argv.slice(2)
const profile = mkdtempSync(join(tmpdir(), 'streamgate-chromium-'))
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM_PATH ?? '/usr/bin/chromium',
  headless: true,
  viewport: {width: 1280, height: 980},
  colorScheme: 'light',
  args: ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking', '--disable-component-update'],
})
try {
  const page: Page = await context.newPage()
  await page.goto(url)
  await page.waitForSelector('#run[data-tools=gateway]', {state: 'attached'}) // the tools listed by the gateway itself
  const run = async (tool: string) => {
    await page.selectOption('#tool', tool)
    await page.click('#run button[type=submit]')
    const job = page.locator(`article.job[data-tool=${tool}]`).first()
    await job.locator('xpath=self::*[@data-state!="running"]').waitFor({timeout: 120_000})
    return job
  }
  await run('predict')
  await run('generate')
  const lens = await run('logit_lens')
  await page.evaluate(() => window.scrollTo(0, 0))
  // Hover the last layer at the last position: the model's own next-token prediction.
  const cells = lens.locator('svg.heatmap rect.cell')
  const columns = await lens.locator('svg.heatmap > text.axis[text-anchor=middle]').count()
  await cells.nth(columns - 1).hover()
  await page.locator('#tip').waitFor({state: 'visible'})
  await page.screenshot({path: out})
  console.log(`wrote ${out}`)
} finally {
  await context.close()
  rmSync(profile, {recursive: true, force: true})
}

/** Debian's Chromium for the page tests, driven by playwright-core: found once, never downloaded. */
import {existsSync, mkdirSync} from 'node:fs'
import {join} from 'node:path'

import assert from 'node:assert/strict'

import {chromium, type BrowserContext, type Locator, type Page} from 'playwright-core'

import {WEB} from './gateway.ts'

export const CHROMIUM = process.env.CHROMIUM_PATH ?? '/usr/bin/chromium'
export const ARTIFACTS = join(WEB, 'test-artifacts')
// The browser tests are part of every run: without Chromium they fail, never skip.
if (!existsSync(CHROMIUM)) {
  throw new Error(`no Chromium at ${CHROMIUM}: install Debian's \`chromium\` (apt-get install chromium) or set CHROMIUM_PATH`)
}

/** A headless Chromium with its profile in `profile`; screenshots go to ARTIFACTS. */
export function launch(profile: string): Promise<BrowserContext> {
  mkdirSync(ARTIFACTS, {recursive: true})
  return chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking', '--disable-component-update'],
  })
}

/** Press Run; the new job's card (the newest is first). */
export async function run(page: Page): Promise<Locator> {
  const before = await page.locator('article.job').count()
  await page.click('#run button[type=submit]')
  await page.waitForFunction((n) => document.querySelectorAll('article.job').length > n, before)
  return page.locator('article.job').first()
}

/** Wait for the job's card to end, and fail unless it ended in `state`. */
export async function finished(job: Locator, state = 'done'): Promise<void> {
  await job.locator(`xpath=self::*[@data-state!="running"]`).waitFor({timeout: 60_000})
  const actual = await job.getAttribute('data-state')
  if (actual !== state) assert.fail(`the job ended ${actual}, not ${state}:\n${await job.innerText()}`)
}

/** The result as the card's raw view shows it. */
export const rawResult = async <T>(job: Locator) => JSON.parse((await job.locator('.raw pre').textContent()) ?? '{}') as T

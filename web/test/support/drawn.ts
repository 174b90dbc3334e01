/** What each built-in tool's result view draws in a job card: the page tests look for it after a run. */
import type {BuiltinTools} from '../../src/index.ts'

export const DRAWN: {[K in keyof BuiltinTools]: string} = {
  generate: '.result .completion',
  loglikelihood: '.result table',
  logprobs: '.result .logprob-tokens .logprob-token',
  predict: '.result .bars .bar-row',
  logit_lens: '.result svg.heatmap',
  lens_line: '.result svg.plot.line',
  lens_grid: '.result svg.heatmap',
  activation_patching: '.result svg.heatmap',
  embed: '.result svg.plot.scatter',
  fill_mask: '.result .mask-site .bar-row',
  pseudo_loglikelihood: '.result table.pll',
}

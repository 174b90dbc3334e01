/** A ready-to-run params object for each built-in tool: the dashboard's starting forms, and the tests'. */
import type {BuiltinTools, SaeTools} from './generated/types.ts'

export const EXAMPLES: {[K in keyof BuiltinTools]: BuiltinTools[K]['params']} = {
  generate: {prompts: ['The capital of France is'], max_tokens: 24},
  loglikelihood: {prompts: ['The capital of France is', 'The capital of France is'], continuations: [' Paris', ' London']},
  logprobs: {prompts: ['The capital of France is Paris'], top: 3, next_token: true},
  predict: {prompt: 'The capital of France is', top_k: 10},
  logit_lens: {prompt: 'The Eiffel Tower is in the city of', top_k: 5},
  lens_line: {prompt: 'The Eiffel Tower is in the city of', stat: 'probability'},
  lens_grid: {prompt: 'The Eiffel Tower is in the city of', stat: 'probability'},
  // Prompts of the same length in tokens, so every position pairs up.
  activation_patching: {src_prompt: 'The capital of Greece is', tgt_prompt: 'The capital of France is'},
  embed: {texts: ['cat', 'dog', 'kitten', 'car', 'truck', 'bicycle', 'Paris', 'London'], pooling: 'mean'},
  // The masked-LM tools, on proteins (ESM-2): one site masked (BERT's mask is [MASK]); a sequence and a one-residue variant of it.
  fill_mask: {texts: ['MKT<mask>YIAK'], top_k: 5},
  pseudo_loglikelihood: {sequences: ['MKTAYIAKQR', 'MKTAYLAKQR'], per_position: true},
}

/** The same for the SAE tools, which a gateway serves only with `--sae` (feature 0 exists in any SAE). */
export const SAE_EXAMPLES: {[K in keyof SaeTools]: SaeTools[K]['params']} = {
  sae_features: {limit: 50},
  sae_annotate: {prompt: 'The Eiffel Tower is in the city of', mode: 'top', k: 5},
  sae_steer: {prompts: ['The capital of France is'], max_tokens: 24, clamps: [{feature_id: 0, strength: 8}]},
}

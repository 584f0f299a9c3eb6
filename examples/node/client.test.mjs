// node --test examples/node/: runs the example against the service at ROLLOUT_TARGET
// (tests/integration/test_client_examples.py starts one, over TLS with a token).
import assert from "node:assert/strict";
import { test } from "node:test";

import { run, validateGroup } from "./client.mjs";

test("the example streams, validates and acks groups, and the service counts them", { timeout: 240_000 }, async () => {
  const lines = [];
  const result = await run({ groups: 3, groupSize: 4, log: (line) => lines.push(line) });
  assert.equal(result.received.length, 3);
  assert.equal(new Set(result.received).size, 3);
  assert.equal(result.groupsTrained, 3);
  assert.ok(lines.some((line) => line.startsWith("stats: 3 groups trained")), lines.join("\n"));
});

test("a malformed group is refused", () => {
  const sample = { completion_token_ids: [2, 3], completion_logprobs: [-1], completion_mask: [1, 1], advantage: 0 };
  const group = { group_id: "g", prompt_token_ids: [1], samples: [sample, sample], delivery_attempt: 1 };
  assert.throws(() => validateGroup(group, 2), /differ in length/);
});

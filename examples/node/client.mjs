// A Node.js client of the rollout service, written from proto/rollout/v1/rollout.proto:
// health check, a run, a credit-based stream with acks (each group validated), stats.
//
//   node examples/node/client.mjs              # ROLLOUT_TARGET (default 127.0.0.1:50051)
//   ROLLOUT_TLS_CA=ca.crt ROLLOUT_TOKEN=... node examples/node/client.mjs
//
// What the proto alone does not say, and this client does about it (see the README):
// - 64-bit fields (policy versions, counters) arrive as Long objects unless `longs` is set:
//   loaded here with longs: String, and compared as numbers.
// - the server sends up to 64 MiB per message; clients receive 4 MiB by default: raised here.
// - one invalid ack ends the whole stream with its status: ack only ids this stream received.
// - ACK_STATUS_UNSPECIFIED counts as TRAINED: say TRAINED or DROPPED_STALE explicitly.
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const here = dirname(fileURLToPath(import.meta.url));
const LOAD_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

function load(file, includeDir) {
  return grpc.loadPackageDefinition(protoLoader.loadSync(file, { ...LOAD_OPTIONS, includeDirs: [includeDir] }));
}

const rollout = load("rollout/v1/rollout.proto", join(here, "..", "..", "proto")).rollout.v1;
const health = load("health.proto", here).grpc.health.v1;

/** Channel credentials and call metadata from the environment, as the Python clients read them. */
export function connection(env = process.env) {
  let credentials = grpc.credentials.createInsecure();
  if (env.ROLLOUT_TLS_CA) {
    const read = (name) => (env[name] ? readFileSync(env[name]) : null);
    credentials = grpc.credentials.createSsl(read("ROLLOUT_TLS_CA"), read("ROLLOUT_TLS_KEY"), read("ROLLOUT_TLS_CERT"));
  }
  const metadata = new grpc.Metadata();
  const token = env.ROLLOUT_TOKEN || (env.ROLLOUT_TOKEN_FILE ? readFileSync(env.ROLLOUT_TOKEN_FILE, "utf8").trim() : "");
  if (token) metadata.set("authorization", `Bearer ${token}`);
  return { target: env.ROLLOUT_TARGET || "127.0.0.1:50051", credentials, metadata };
}

const deadline = (seconds) => new Date(Date.now() + seconds * 1000);

function unary(client, method, request, metadata, seconds = 30) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: deadline(seconds) }, (error, response) =>
      error ? reject(error) : resolve(response),
    );
  });
}

/** Throws unless the group is well formed: G samples, aligned ids/logprobs/mask, advantages centred. */
export function validateGroup(group, groupSize) {
  if (group.samples.length !== groupSize) throw new Error(`group ${group.group_id}: ${group.samples.length} samples`);
  for (const sample of group.samples) {
    const n = sample.completion_token_ids.length;
    if (n === 0 || sample.completion_logprobs.length !== n || sample.completion_mask.length !== n) {
      throw new Error(`group ${group.group_id}: completion ids, logprobs and mask differ in length`);
    }
  }
  // The prompt's ids come once per group (older servers sent them in every sample instead).
  if (group.prompt_token_ids.length === 0) throw new Error(`group ${group.group_id}: no prompt ids`);
  const mean = group.samples.reduce((sum, s) => sum + s.advantage, 0) / groupSize;
  if (Math.abs(mean) > 1e-3) throw new Error(`group ${group.group_id}: advantages average ${mean}, not 0`);
  // 1 the first time; more if an earlier holder left without acking (it may have trained it).
  if (!(group.delivery_attempt >= 1)) throw new Error(`group ${group.group_id}: no delivery_attempt`);
}

/** Health, a run, `groups` groups streamed with credits and acked, then stats. */
export async function run({ groups = 4, groupSize = 4, env = process.env, log = console.log } = {}) {
  const { target, credentials, metadata } = connection(env);
  const options = { "grpc.max_receive_message_length": MAX_MESSAGE_BYTES };
  const healthClient = new health.Health(target, credentials, options);
  const client = new rollout.RolloutService(target, credentials, options);
  try {
    const status = await unary(healthClient, "Check", { service: "" }, new grpc.Metadata(), 10);
    if (status.status !== "SERVING") throw new Error(`service health is ${status.status}`);
    const spec = {
      prompt_source: { dataset: "repeat_a" },
      sampling: { max_tokens: 8 },
      group_size: groupSize,
      reward_functions: [{ name: "char_fraction", weight: 1 }],
      max_buffered_groups: groups,
    };
    const created = (await unary(client, "CreateRun", { spec }, metadata)).run;
    log(`run ${created.run_id} at policy version ${Number(created.policy_version)}`);

    const received = await stream(client, metadata, created.run_id, groups, groupSize, log);
    const stats = await unary(client, "GetStats", {}, metadata);
    const runStats = stats.runs[created.run_id];
    log(`stats: ${Number(runStats.groups_trained)} groups trained, ${Number(stats.tokens_generated)} tokens generated`);
    await unary(client, "DeleteRun", { run_id: created.run_id }, metadata);
    return { runId: created.run_id, received, groupsTrained: Number(runStats.groups_trained) };
  } finally {
    client.close();
    healthClient.close();
  }
}

function stream(client, metadata, runId, groups, groupSize, log) {
  return new Promise((resolve, reject) => {
    const call = client.StreamSamples(metadata, { deadline: deadline(240) });
    const received = [];
    call.on("data", (message) => {
      if (message.kind === "subscribed") return;
      if (message.kind !== "group") return; // weights_wanted: for a pushing trainer
      try {
        validateGroup(message.group, groupSize);
      } catch (error) {
        call.cancel();
        reject(error);
        return;
      }
      received.push(message.group.group_id);
      const rewards = message.group.samples.map((s) => s.reward.toFixed(2)).join(" ");
      log(`group ${message.group.group_id} (delivery ${message.group.delivery_attempt}): rewards ${rewards}`);
      // An ack frees the group; no new credit is granted once enough are on their way.
      call.write({ ack: { group_ids: [message.group.group_id], status: "ACK_STATUS_TRAINED" } });
      if (received.length === groups) call.end();
    });
    call.on("error", (error) => (error.code === grpc.status.CANCELLED ? null : reject(error)));
    call.on("end", () => resolve(received));
    call.write({ subscribe: { run_id: runId, consumer_id: "node-example", initial_credits: groups } });
  });
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  run().catch((error) => {
    console.error(`error: ${error.details || error.message}`);
    process.exit(1);
  });
}

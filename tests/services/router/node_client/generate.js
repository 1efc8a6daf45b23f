// A non-Python client of the specserve router: loads protos/ at run time with @grpc/proto-loader and
// streams one RouterService.Generate with @grpc/grpc-js. Prints one JSON object on stdout:
//   {"session_id", "token_ids", "text", "finish_reason", "stats", "num_messages"}
// A failed call prints {"error": {"code", "details"}} and exits with 1.
//
// usage: node generate.js --address HOST:PORT --protos DIR --prompt TEXT
//                         [--max-new-tokens N] [--method NAME] [--timeout-seconds S]
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

function parseArgs(argv) {
  const options = { maxNewTokens: 16, method: "", timeoutSeconds: 120 };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    switch (flag) {
      case "--address": options.address = value; break;
      case "--protos": options.protos = value; break;
      case "--prompt": options.prompt = value; break;
      case "--max-new-tokens": options.maxNewTokens = Number(value); break;
      case "--method": options.method = value; break;
      case "--timeout-seconds": options.timeoutSeconds = Number(value); break;
      default: throw new Error(`unknown flag ${flag}`);
    }
  }
  for (const required of ["address", "protos", "prompt"]) {
    if (!options[required]) throw new Error(`--${required} is required`);
  }
  return options;
}

function main() {
  const options = parseArgs(process.argv.slice(2));
  const definition = protoLoader.loadSync("specserve/v1/router.proto", {
    includeDirs: [path.resolve(options.protos)],
    keepCase: true, // field names exactly as in the .proto files
    longs: String, // uint64 / int64 as decimal strings (no precision loss)
    enums: String, // enum values by name
    defaults: true,
  });
  const specserve = grpc.loadPackageDefinition(definition).specserve.v1;
  const client = new specserve.RouterService(options.address, grpc.credentials.createInsecure());

  const request = {
    prompt: options.prompt,
    max_new_tokens: options.maxNewTokens,
    method: options.method,
    sampling: { temperature: 0 }, // greedy; seed unset: the router picks one
  };
  const deadline = new Date(Date.now() + options.timeoutSeconds * 1000);
  const result = { session_id: "", token_ids: [], text: "", finish_reason: "", stats: null, num_messages: 0 };
  const call = client.Generate(request, { deadline });
  call.on("data", (message) => {
    if (message.index !== result.token_ids.length) {
      throw new Error(`message index ${message.index}, expected ${result.token_ids.length}`);
    }
    result.session_id = message.session_id;
    result.token_ids.push(...message.token_ids);
    result.text += message.text;
    result.num_messages += 1;
    if (message.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      result.finish_reason = message.finish_reason;
      result.stats = message.stats;
    }
  });
  let failed = false;
  call.on("error", (error) => {
    failed = true;
    process.stdout.write(JSON.stringify({ error: { code: error.code, details: error.details } }) + "\n");
    process.exitCode = 1;
    client.close();
  });
  call.on("end", () => {
    if (!failed) process.stdout.write(JSON.stringify(result) + "\n");
    client.close();
  });
}

main();

"""The rollout orchestrator process: `main.main(cfg, run_dir)` (run by `jobs/rollout.py RUN_DIR`).

main.py          the process: load the agent, prompts and tokenizer, wait for the router, run the loop
orchestrator.py  the loop: groups in flight, completion order, filters, buffer puts
admission.py     staleness admission: how many groups may be in flight, which finished group lands stale
group.py         one group of concurrent samples and the per-sample fault policy
engines.py       generate through the router; the engines' weight version
resume.py        one turn's request as segments: when its engine dies, it continues elsewhere from its tokens
chat_server.py   the OpenAI-compatible endpoint chat-mode agents talk to (chat_schema.py: its request body)
chat_answer.py   the endpoint's answers in OpenAI's shapes: a `chat.completion` of n choices and its parts
chat_stream.py   `stream: true` on the endpoint: the reply as `chat.completion.chunk` server-sent events
tool_calls.py    tool calls read from a reply (rollout.tool_parser) and how tool_choice is honoured
evaluation.py    held-out evaluation: n samples per prompt, pass@k, mean reward
state.py         the durable state (cursor, in-flight groups) that makes a restart exact
metrics.py       the rollout records of metrics.jsonl
scoring.py       a reward model's scores combined with the env's rewards, once per finished group
teacher.py       a distillation teacher's log-probs of every action token, once per finished group
"""

"""A real RL loop on reshard: GRPO on a tiny Qwen3, FSDP2 trainers, vLLM rollouts, a refit after every update.

    task.py         the toy task (share of word-piece tokens) and its prompts
    grpo.py         group-relative advantages, token log-probs, the clipped policy-gradient loss
    policy.py       a trainer rank: FSDP2 model, AdamW, GRPO step, refit by reshard / hybrid /
                    gather-broadcast / checkpoint
    rollout.py      the rollout engine: a vLLM engine (backend "reshard") as an actor
    orchestrate.py  local processes or Ray actors (placement groups); bounded, complete cleanup
    loop.py         generate -> reward -> train -> refit, timed per phase, versions checked
    report.py       tables and pictures of a run
    chaos.py        seeded schedules of faults and membership changes (--chaos)
    fleet.py        several engines: states, the prompt split, fault records
    chaos_loop.py   the loop over several engines through faults and membership changes
    chaos_report.py faults, goodput and the picture of a chaos run

``reshard rl-demo`` runs it (see ``docs/rl_loop.md``).
"""

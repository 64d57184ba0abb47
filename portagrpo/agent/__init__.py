"""Tool use in multi-turn rollouts (rollout/generators/conversation.py): the tool file and built-ins (tools.py), the
sandbox the calls run in (sandbox.py), and the Hermes format the calls and results are written in (hermes.py)."""

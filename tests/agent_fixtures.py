"""Agents for tests/test_gateway.py, written against the OpenAI API as users write them (rollout.agent), importable
by the episode workers (tests/ is on their path)."""

import time


def text_turns(client, row):
    """Two /v1/completions calls: the prompt, then the text so far with a line of its own added."""
    first = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=40)
    text = row["prompt"] + first.choices[0].text
    if first.choices[0].finish_reason == "stop":
        client.completions.create(model="policy", prompt=text + "\ncheck:", max_tokens=8)
    return 0.5


def faulty(client, row):
    """What the row's prompt says: `raises` after a request, `hangs`, returns `garbage`, `rewrites` the conversation
    it got back or asks for `two` completions at once (the gateway refuses both); else one request and 0.75."""
    first = [{"role": "user", "content": row["prompt"]}]
    reply = client.chat.completions.create(model="policy", messages=first, max_tokens=4)
    if row["prompt"] == "raises":
        raise RuntimeError("the agent failed on purpose")
    if row["prompt"] == "hangs":
        time.sleep(60)
    if row["prompt"] == "garbage":
        return "yes"
    if row["prompt"] == "rewrites":
        edited = {"role": "assistant", "content": (reply.choices[0].message.content or "") + " (edited)"}
        client.chat.completions.create(model="policy", messages=[*first, edited, {"role": "user", "content": "go on"}])
    if row["prompt"] == "two":
        client.chat.completions.create(model="policy", messages=first, n=2)
    return 0.75


def streaming(client, row):
    """A streamed chat completion (as verifiers asks for them), then a second turn that sends the first back with its
    content left out. -> reward = the completion tokens the usage chunk reports; chars = the streamed text's length."""
    first = [{"role": "user", "content": row["prompt"]}]
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model="policy", messages=first, max_tokens=40, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    if finish == "stop":
        client.chat.completions.create(model="policy", max_tokens=4, messages=[
            *first, {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}])
    return {"reward": float(usage.completion_tokens), "chars": float(len(text))}


def pid_or_retire(item):
    """A worker-pool task: this worker's pid; the item "retire" asks for the worker to be replaced after it."""
    import os

    from rlcli.core.workers import retire_after_reply

    if item == "retire":
        retire_after_reply()
    return os.getpid()

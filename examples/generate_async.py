"""Stream several requests at once through `LLM.generate_async` (they share one batch).

Run: ``python examples/generate_async.py`` (the trained ``small`` preset, on the CPU in a few seconds).
"""

from __future__ import annotations

import asyncio

from trtllm_glm import LLM, SamplingParams


async def main() -> None:
    llm = LLM(model="small")
    sp = SamplingParams(max_tokens=48)
    # The first request streams; the other two are awaited whole. All three share the engine's batch.
    others = [llm.generate_async(p, sp) for p in ("import os\n", "class Queue:")]
    printed = 0
    async for part in llm.generate_async("    def __init__(self", sp, streaming=True):
        text = part.outputs[0].text
        print(text[printed:], end="", flush=True)
        printed = len(text)
    print()
    for out in await asyncio.gather(*others):
        print(repr(out.prompt), "->", repr(out.outputs[0].text))
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())

"""The adding tool, served to the model over MCP (verifiers runs it as ``python -m``)."""

import verifiers.v1 as vf


class AddingToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    AddingToolset.run()

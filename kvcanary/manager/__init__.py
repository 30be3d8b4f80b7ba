"""KvCanary: the object a serving engine holds, its assembly and its HEAD/TAIL step launches."""

"""Only even steps use the decoder branch; run with TORCH_DISTRIBUTED_DEBUG=INFO."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(24, 24)
        self.decoder = nn.Linear(24, 24)
        self.proj = nn.Linear(24, 1)

    def forward(self, x, use_decoder):
        h = torch.relu(self.encoder(x))
        if use_decoder:
            h = self.decoder(h)
        return self.proj(h)


def main():
    dist.init_process_group(backend="gloo")
    model = DistributedDataParallel(EncoderDecoder())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        out = model(torch.randn(6, 24), use_decoder=(step % 2 == 0))
        optimizer.zero_grad()
        out.mean().backward()
        optimizer.step()


if __name__ == "__main__":
    main()

"""The same classifier over a BERT encoder, fixed the way such code is: the
encoder is built without the pooler it never reads (no finding expected).

Runs under torchrun: every parameter gets a gradient in each backward.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import BertConfig, BertModel


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.bert(input_ids=ids)
        return self.head(out.last_hidden_state[:, 0])


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(Classifier())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(4):
        ids = torch.randint(0, 64, (4, 8))
        loss = nn.functional.cross_entropy(model(ids), torch.randint(0, 3, (4,)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("trained", flush=True)
    # DDP freed while its process group lives: freed after destroy_process_group, as
    # main's locals are when it returns, its teardown sometimes never finished
    # (session 48: 3 of 27 launches on a loaded machine, the worker waiting at the
    # line that calls main(); 0 of 30 with this del).
    del model, optimizer, loss
    # both ranks done before either tears down gloo: a rank that destroyed its group
    # while the other still shut its own down left that one waiting (seen under load)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A classifier over a BERT encoder that reads the [CLS] token's state and never
the pooled output, under a DDP that expects a gradient for every parameter each
step: BertModel builds its pooler by default, and the pooler gets none.

Runs under torchrun (gloo, CPU): the second step raises "Expected to have
finished reduction in the prior iteration".
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
        self.bert = BertModel(config)  # expect: unused-parameters
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
    # both ranks done before either tears down gloo: a rank that destroyed its group
    # while the other still shut its own down left that one waiting (seen under load)
    dist.barrier()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

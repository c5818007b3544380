"""ring-harness: run ring attention on a pool of ranks and judge every rank against float64 attention."""

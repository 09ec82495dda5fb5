"""The package's private helpers, shared by every room and importing none of them (torch and the standard
library only; matplotlib lazily): argument checks (``validate``), config fields with their help (``fields``),
atomic file writes (``files``), text and JSON files read with errors naming the file (``jsonfile``), figures
without pyplot (``plot``), seeds (``seeds``), timing for the choices measured here (``timing``)."""

"""Control-plane floor, above the router: the controller, its instances and the routers' clients of them."""
